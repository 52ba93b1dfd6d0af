"""The run directory's names: process names decode back to what named them, and each file
name is spelled in one place (orchestrator.results.rundir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.results.rundir import ProcName, RunFiles, parse_proc_name, proc_name


@pytest.mark.parametrize("kind,index,count,tp_rank,tp", [
    ("prefill", 0, 1, 0, 1), ("prefill", 3, 4, 0, 1), ("decode", 0, 1, 0, 1), ("decode", 2, 3, 0, 1),
    ("decode", 1, 2, 0, 2), ("decode", 1, 2, 3, 4), ("decode", 0, 1, 1, 2),
])
def test_proc_name_decodes_back(kind, index, count, tp_rank, tp):
    name = proc_name(kind, index, count, tp_rank, tp)
    assert parse_proc_name(name) == ProcName(kind, index, tp_rank)
    assert parse_proc_name(name).tp_leader is (tp_rank == 0)


@pytest.mark.parametrize("name", ["", "decoder", "decode.1", "prefill-1", "verdicts-decode0"])
def test_parse_proc_name_refuses_other_names(name):
    with pytest.raises(ValueError):
        parse_proc_name(name)


def test_run_files(tmp_path: Path):
    files = RunFiles(tmp_path)
    assert files.requests("prefill", 1).name == "requests.jsonl"
    assert files.requests("prefill1", 2).name == "requests-prefill1.jsonl"
    assert files.decisions("prefill0", 2).name == "decisions-prefill0.jsonl"
    assert files.verdicts("decode1.0").name == "verdicts-decode1.0.jsonl"
    assert files.results == tmp_path / "results.json"
    assert [files.log("decode").name, files.stderr_log("decode").name, files.mooncake_log("decode").name] == \
        ["decode.log", "decode.stderr.log", "decode.mooncake.log"]
    for name in ("verdicts-decode0.1.jsonl", "verdicts-decode0.0.jsonl", "requests-prefill1.jsonl",
                 "requests-prefill0.jsonl"):
        (tmp_path / name).write_text("")
    assert [(p.tp_rank, f.name) for p, f in files.all_verdicts()] == \
        [(0, "verdicts-decode0.0.jsonl"), (1, "verdicts-decode0.1.jsonl")]
    assert [f.name for f in files.all_requests()] == ["requests-prefill0.jsonl", "requests-prefill1.jsonl"]
