"""One error style for every command: each refusal the docs name (Hydra's own errors too: an
unknown key, value or group option, a wrong type, an ambiguous value, a syntax error, two
modes at once, an unknown flag) is one `error: ...` line and exit 2 from every entry point
it applies to, with the did-you-mean where there is one, no traceback, no Hydra hint that
leads nowhere, and no run dir left behind. `--help` lists every key of the schema."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _orchestrator(argv):
    import orchestrator.__main__ as cli

    sys.argv = ["orchestrator", *argv]
    cli._entry()


def _bench(argv):
    from orchestrator import bench

    sys.argv = ["orchestrator.bench", *argv]
    bench.main()


def _doctor(argv):
    from orchestrator.preflight import doctor

    return doctor.main(argv)


def _export_env(argv):
    from orchestrator.preflight import export_env

    return export_env.main(argv)


HYDRA = {"orchestrator": _orchestrator, "bench": _bench}  # the commands Hydra parses
ALL = {**HYDRA, "doctor": _doctor, "export_env": _export_env}

REFUSALS = [  # (command line, what the line must say, the entry points it applies to)
    (["buffers.sise=3"], "There is no key buffers.sise; did you mean buffers.size?", ALL),
    (["bench.iterz=3"], "did you mean bench.iters?", ALL),
    (["workload.concurency=3"], "did you mean workload.concurrency?", ALL),
    (["transport.route=foo"], "Invalid value 'foo', expected one of [auto, tcp, engine]", ALL),
    (["mem_pool=FOO"], "Could not find 'mem_pool/FOO'; Available options in 'mem_pool': BAREX, "
                       "INTRA_NODE_NVLINK, NONE, NVLINK", ALL),
    (["buffers.size=abc"], "Value 'abc' of type 'str' could not be converted to Integer", ALL),
    (["buffers.size=0"], "buffers.size=0 is not allowed: a whole number of slots > 0.", ALL),
    (["+buffers.extra=1"], "buffers.extra=1 is not allowed", ALL),
    (["buffers.hidden_size=16,4096"], "buffers.hidden_size=16,4096 is ambiguous: a sweep over "
                                      "16,4096 needs -m", ALL),
    (["buffers.size==3"], "Error parsing override 'buffers.size==3'", ALL),
    (["--bogus"], "unrecognized arguments: --bogus", ALL),
    (["-m", "buffers.hidden_size=16,4096", "--cfg", "job"], "-m and --cfg cannot be given together", HYDRA),
    (["--resolve"], "--resolve goes with --cfg", HYDRA),
]
CASES = [(argv, needle, name, entry) for argv, needle, entries in REFUSALS for name, entry in entries.items()]


@pytest.mark.parametrize("argv,needle,name,entry", CASES,
                         ids=[f"{name}: {' '.join(argv)}" for argv, _, name, _ in CASES])
def test_a_refusal_is_one_error_line_and_exit_2_everywhere(argv, needle, name, entry, capsys, monkeypatch,
                                                           tmp_path):
    monkeypatch.chdir(tmp_path)  # a Hydra run dir would appear under outputs/ here
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as info:
        entry(argv)
    out = capsys.readouterr()
    assert info.value.code == 2, out
    assert out.out == ""
    assert out.err.startswith("error: ") and out.err.count("\n") == 1, out.err
    assert needle in out.err, out.err
    assert "Traceback" not in out.err and "HYDRA_FULL_ERROR" not in out.err
    assert "To append" not in out.err and " +" not in out.err  # Hydra's hint leads nowhere
    assert list(tmp_path.iterdir()) == []  # no run dir, nothing written


def _real(module: str, *argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_the_real_bench_command_leaves_no_run_dir(tmp_path):
    """What the issue saw: `bench buffers.size=0` exited 2 and left outputs/<date>/<time>/."""
    proc = _real("orchestrator.bench", "buffers.size=0", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == "error: buffers.size=0 is not allowed: a whole number of slots > 0.\n"
    assert list(tmp_path.iterdir()) == []


def test_the_real_command_line_refuses_cfg_with_m(tmp_path):
    """docs/sweeps.md once showed `-m ... --cfg job`: a ValueError traceback, exit 1."""
    proc = _real("orchestrator", "-m", "buffers.hidden_size=16,4096", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: -m and --cfg cannot be given together") and proc.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_help_lists_every_key_with_its_default_and_meaning(capsys, monkeypatch, tmp_path):
    from orchestrator.preflight.compose import composed_defaults
    from orchestrator.profile.keys import keys, value_text

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as info:
        _orchestrator(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "== Config groups" in out  # Hydra's own part stays
    listed = {line.split("=", 1)[0]: line for line in out.split("== Keys", 1)[1].splitlines()[1:]
              if line and not line.startswith(" ")}
    every = keys(composed_defaults())
    assert len(every) > 70 and set(listed) == {k.name for k in every}
    for k in every:
        assert listed[k.name].startswith(f"{k.name}={value_text(k.default)}")
    assert [k.name for k in every if not k.doc] == []  # the schema says what each key decides
    assert "buffers.size=64" in out and "slots" in listed["buffers.size"]
    assert all(c in listed["transport.route"] for c in ("auto", "tcp", "engine"))
