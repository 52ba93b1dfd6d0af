"""The suite's own scheduling. `make test` runs pytest-xdist with --dist loadgroup: a module
marked xdist_group (the Slurm cluster, the netns pairs and their cut runs, the real sweep) runs
on one worker, its module fixtures built once. pytest-xdist tells the scheduler a test's group
by renaming its node id `<id>@<group>`; under pytest 9.2 (pytest-xdist 3.8) the rename is lost,
every group is spread over the workers as if ungrouped, and each worker builds those fixtures
again (and again whenever its tests of another module come in between). This test fails then,
rather than the suite only getting slower."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("suite_groups")


def test_a_grouped_test_is_scheduled_by_its_group(request):
    if not getattr(request.config.option, "loadgroup", False):  # (set on a worker of --dist loadgroup)
        pytest.skip("runs in a pytest-xdist worker under --dist loadgroup (make test)")
    assert request.node.nodeid.endswith("@suite_groups"), (
        f"pytest {pytest.__version__} lost pytest-xdist's group of {request.node.nodeid!r}: "
        "--dist loadgroup groups nothing (install pytest<9.2, as pyproject.toml's test extra says)")
