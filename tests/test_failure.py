"""The failure policy (issue 38, item 7): one table maps each exception a command ends on to
its exit code and its line (orchestrator.job.failure); results.json's codes, docs/running.md's
"Exit codes" and README say the same numbers; a command's codes travel in a Command, not in
module globals."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest

from .conftest import ROOT


def test_a_subclass_ends_as_its_nearest_row():
    from orchestrator.job import failure
    from orchestrator.preflight.compose import ProfileError
    from orchestrator.results.rundir import NoSpace, RunDirBusy, UnsafePath

    assert failure.rule(UnsafePath("x")) is failure.TABLE[RunDirBusy]
    assert failure.rule(NoSpace("/x")) is failure.TABLE[NoSpace]  # not OSError's catch-all
    assert failure.rule(ProfileError("x")) is failure.TABLE[Exception]  # compose says it: error_exit


def test_the_codes_are_results_json_codes():
    from orchestrator.job import failure
    from orchestrator.profile.config import ConfigError
    from orchestrator.results.rundir import NoSpace, RunDirBusy
    from orchestrator.results.schema import EXIT_LOST, EXIT_NOT_VERIFIED, EXIT_REFUSED, EXIT_SIGNAL

    code = lambda exc: failure.ending(exc).code  # noqa: E731
    assert code(failure.Refusal("x")) == code(ConfigError("k", 1, "no")) == code(RunDirBusy("x")) == EXIT_REFUSED
    assert code(NoSpace("/x")) == code(RuntimeError("x")) == EXIT_LOST
    assert code(failure.RowsFailed("x")) == EXIT_NOT_VERIFIED
    for name, value in EXIT_SIGNAL.items():
        sig = signal.Signals[name]
        assert code(failure.EarlyStop(sig)) == code(failure.Stopped(name)) == value
        assert code(failure.SweepStopped(value, "d")) == value
    assert code(KeyboardInterrupt()) == EXIT_SIGNAL["SIGINT"]


def test_the_docs_list_every_code():
    from orchestrator.job import failure
    from orchestrator.results.schema import EXIT_SIGNAL

    text = (ROOT / "docs" / "running.md").read_text()
    table = text[text.index("| code | meaning |"):].split("\n\n")[0]
    documented = {int(c) for c in re.findall(r"^\| ([\d /]+) \|", table, re.M) for c in c.split("/")}
    fixed = {r.code for r in failure.TABLE.values() if r.code is not None}
    assert fixed | set(EXIT_SIGNAL.values()) <= documented, documented


def test_the_lines():
    from orchestrator.job import failure
    from orchestrator.results.rundir import NoSpace

    assert failure.ending(KeyboardInterrupt(), phase="importing").line == \
        "interrupted (SIGINT) while importing: no job was running"
    assert failure.ending(failure.EarlyStop(signal.SIGTERM), phase="x").line == \
        "interrupted (SIGTERM) while x: no job was running"
    assert failure.ending(NoSpace("/d/f")).line == "error: no space left writing /d/f"
    assert failure.ending(NoSpace("/d/f"), "no space left writing f").line == "error: no space left writing f"
    assert failure.ending(ValueError("bad")).line == "job failed: ValueError: bad"
    assert failure.ending(failure.Stopped("SIGINT")).line == ""
    assert failure.unforeseen(ValueError("bad")) and not failure.unforeseen(NoSpace("/d/f"))
    with pytest.raises(LookupError):
        failure.ending(GeneratorExit())


def test_a_command_is_found_only_while_it_runs():
    from orchestrator.job import failure

    command = failure.Command(jobs=[0, 1])
    assert failure.current() is not failure.current()  # none runs: a fresh one nobody reads
    with failure.running(command):
        assert failure.current() is command
        failure.current().sweep.append(3)
    assert failure.current() is not command
    assert command.exit_code() == 3 and failure.Command().exit_code() is None


def test_the_policy_imports_nothing_heavy():
    """python -m orchestrator says an interrupt with it before its other imports."""
    code = ("import sys; import orchestrator.job.failure; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('orchestrator', 'hydra', 'omegaconf', 'torch',"
            " 'yaml', 'structlog')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(sorted(["orchestrator", "orchestrator.job", "orchestrator.job.failure",
                                             "orchestrator.profile", "orchestrator.profile.kinds",
                                             "orchestrator.profile.proc_names", "orchestrator.results",
                                             "orchestrator.results.rundir"])), out
