"""Docs that cannot drift: every `python -m orchestrator...` command in README.md and docs/*.md
at least parses (Hydra composes its overrides, the tool's own parser accepts its flags),
without running it; the console samples have the shape the tools print now
(tools/doc_samples.py regenerates them); the column tables are the ones the code writes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from .conftest import ROOT

DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(text: str) -> tuple[list[tuple[str, list[str]]], str]:
    """Every command line of the fenced code blocks but yaml/json ones (continuations joined;
    in a console sample only the `$ ` lines, each with the output lines after it), and the
    prose with code blocks blanked out."""
    blocks: list[list[str]] = []
    prose, fence = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            if fence is not None:
                blocks.append([])
            prose.append("")
        elif fence is None:
            prose.append(line)
        elif fence not in ("yaml", "json"):
            block = blocks[-1]
            if block and block[-1].endswith("\\"):
                block[-1] = block[-1][:-1] + " " + line.strip()
            else:
                block.append(line)
    out = []
    for block in blocks:
        console = any(x.startswith("$ ") for x in block)
        for i, line in enumerate(block):
            if not console:
                out.append((line, []))
            elif line.startswith("$ "):
                rest = block[i + 1:]
                end = next((j for j, x in enumerate(rest) if x.startswith("$ ")), len(rest))
                out.append((line[2:], rest[:end]))
    return out, "\n".join(prose)


PLACEHOLDERS = {"HOST_B:PORT": "192.0.2.2:5555", "HOST:PORT": "192.0.2.2:5555"}


def _args(tokens: list[str]) -> list[str]:
    """The arguments, without a usage synopsis' placeholders ([overrides], [--json],
    KEY=VALUE, ...) and with an address placeholder made an address."""
    argv, bracket = [], False
    for token in tokens:
        if token.startswith((")", ";", "|", "&", ">", "#", "2>")):
            break
        if token.startswith("[") and argv and argv[-1].startswith("--") and not bracket:
            argv.append(token)  # a placeholder value: --peer "[prefill overrides]"
            continue
        if token.startswith("[") and "=" not in token or bracket:
            bracket = not token.endswith("]")
            continue
        key, _, value = token.partition("=")
        if token == "..." or (value and key.isupper()):
            continue
        argv.append(f"{key}={PLACEHOLDERS.get(value, value)}" if value else token)
    return argv


def commands() -> list[tuple[str, str, list[str], list[str]]]:
    """(where, module, argv, the sample's output) of every documented command."""
    out = []
    for path in DOCS:
        lines, prose = _blocks(path.read_text())
        spans = [(x, []) for x in re.findall(r"`(python -m orchestrator[^`]*)`", prose.replace("\n", " "))
                 if len(x.split()) > 3 or x.strip() == "python -m orchestrator"]  # not a bare name
        for text, output in [*lines, *spans]:
            for m in re.finditer(r"python -m (orchestrator[\w.]*)", text):
                try:
                    tokens = shlex.split(text[m.end():], comments=True)
                except ValueError:  # e.g. inside "$(...)"
                    tokens = text[m.end():].split()
                out.append((f"{path.relative_to(ROOT)}: {text.strip()[:100]}", m.group(1), _args(tokens),
                            output))
    return out


def _unique(found):
    """One case per distinct command line and sample (the README repeats docs/ lines)."""
    seen, out = set(), []
    for where, module, argv, output in found:
        key = (module, tuple(argv), next((x for x in output if x.startswith("error: ")), None))
        if key not in seen:
            seen.add(key)
            out.append((where, module, argv, output))
    return out


COMMANDS = _unique(commands())


def _parses(module: str, argv: list[str]) -> None:
    from orchestrator.preflight.compose import load_profile, precheck

    if module in ("orchestrator", "orchestrator.bench"):
        problem = precheck(argv, rules=False)  # composes every value of a sweep; runs nothing
        assert problem is None, problem
        return
    if module in ("orchestrator.doctor", "orchestrator.export_env"):
        from orchestrator.preflight import doctor, export_env

        tool = doctor if module == "orchestrator.doctor" else export_env
        args = tool.build_parser().parse_args(argv)
        load_profile(args.overrides)
        if getattr(args, "peer", None) and not args.peer.startswith("["):
            load_profile(shlex.split(args.peer))
        return
    if module == "orchestrator.report":
        from orchestrator.sweep import report as tool
    elif module == "orchestrator.replay":
        from orchestrator.sweep import replay as tool  # type: ignore[no-redef]
    else:
        raise AssertionError(f"python -m {module}: no such command")
    tool.build_parser().parse_args(argv)


def test_the_docs_show_commands():
    modules = {m for _, m, _, _ in COMMANDS}
    assert len(COMMANDS) > 50 and {"orchestrator", "orchestrator.bench", "orchestrator.doctor",
                                   "orchestrator.export_env", "orchestrator.report",
                                   "orchestrator.replay"} <= modules


def _refusal(module: str, argv: list[str], capsys) -> str:
    """What the tool says refusing `argv` (its own main, in this process; nothing starts)."""
    if module in ("orchestrator", "orchestrator.bench"):
        from orchestrator.preflight.compose import precheck

        problem = precheck(argv)
        return "" if problem is None else f"error: {' '.join(problem.split())}"
    from orchestrator.preflight import doctor, export_env

    tool = {"orchestrator.doctor": doctor, "orchestrator.export_env": export_env}[module]
    try:
        tool.main(argv)
    except SystemExit:
        pass
    return capsys.readouterr().err.strip()


@pytest.mark.parametrize("where,module,argv,output", COMMANDS, ids=[w for w, _, _, _ in COMMANDS])
def test_every_documented_command_parses(where, module, argv, output, capsys):
    """A sample whose output is an `error:` line shows a refusal: the tool says exactly that."""
    refused = next((x for x in output if x.startswith("error: ")), None)
    if refused is not None:
        assert _refusal(module, argv, capsys) == refused, where
        return
    try:
        _parses(module, argv)
    except SystemExit as exc:  # a tool's parser refused it (one error line)
        pytest.fail(f"{where}: exit {exc.code}: {capsys.readouterr().err.strip()}")


# ---- generated tables ------------------------------------------------------------------------
def test_every_summary_column_is_described_once():
    from orchestrator.sweep.columns import undocumented

    assert undocumented() == []


def test_the_docs_tables_are_what_the_code_writes():
    from tools.doc_samples import _tables, tables

    problems: list[str] = []
    for path in DOCS:
        _tables(path, path.read_text(), tables(), problems)
    assert problems == [], "run python tools/doc_samples.py"
    assert "<!-- generated: summary columns -->" in (ROOT / "docs" / "sweeps.md").read_text()


# ---- console samples ---------------------------------------------------------------------------
def _samples():
    from tools.doc_samples import samples

    out = []
    for path in DOCS:
        for s in samples(path):
            if s.skip or any(c in s.command for c in "|;$`<>"):
                continue  # piped and substituted commands: tools/doc_samples.py --check runs them
            words = shlex.split(s.command)
            env = {}
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            if words[:1] == ["cat"] or words[:3] in (["python", "-m", "orchestrator.doctor"],
                                                     ["python", "-m", "orchestrator.export_env"]):
                out.append((s, env, words))
    return out


SAMPLES = _samples()


def test_the_console_samples_are_checked():
    assert len(SAMPLES) >= 10


@pytest.mark.parametrize("sample,env,words", SAMPLES, ids=[f"{s.path.name}:{s.start + 1}" for s, _, _ in SAMPLES])
def test_a_console_sample_has_the_shape_the_tool_prints(sample, env, words, capsys, monkeypatch):
    """Run here, in this process (cheap): the same lines with the same words and keys as the
    docs show, numbers aside; an excerpt (`...`) has its lines in order."""
    from tools.doc_samples import differences

    monkeypatch.chdir(ROOT)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if words[0] == "cat":
        fresh, code = Path(ROOT / words[1]).read_text().splitlines(), 0
    else:
        from orchestrator.preflight import doctor, export_env

        tool = doctor if words[2] == "orchestrator.doctor" else export_env
        try:
            code = tool.main(words[3:])
        except SystemExit as exc:
            code = int(exc.code or 0)
        out = capsys.readouterr()
        fresh = (out.out + out.err).splitlines()
    assert differences(sample, fresh, code) == [], "run python tools/doc_samples.py"


def test_the_run_sample_has_the_shape_a_run_prints(tmp_path, capsys, monkeypatch):
    """README's `$ python -m orchestrator`, run here with fewer requests (its shape is the same)."""
    from orchestrator.job.app import run_job
    from tools.doc_samples import differences, samples

    sample = next(s for s in samples(ROOT / "README.md") if s.command == "python -m orchestrator")
    monkeypatch.chdir(tmp_path)
    from .conftest import compose_cfg

    run_job(compose_cfg("workload.requests=200"), tmp_path / "outputs" / "run")
    assert differences(sample, capsys.readouterr().out.splitlines(), 0) == []
