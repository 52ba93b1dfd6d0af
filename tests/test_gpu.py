"""GPU tests (marker `gpu`, skipped where torch sees no CUDA). Run on the H200 machines:
INTRA_NODE_NVLINK buffers on CUDA, handoffs over Mooncake's intra-node NVLink transport."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch

from orchestrator import MetadataBuffers
from orchestrator.config import MemPoolType
from orchestrator.plan import EngineTransport, make_plan
from orchestrator.platform import detect
from orchestrator.report import build_results
from orchestrator.runner import run_handoffs

pytestmark = pytest.mark.gpu


def test_intra_node_nvlink_buffers_live_on_cuda_with_sglang_layout():
    b = MetadataBuffers(8, 7168, torch.bfloat16, mem_pool=MemPoolType.INTRA_NODE_NVLINK)
    host = MetadataBuffers(8, 7168, torch.bfloat16)
    assert b.device.type == "cuda" and host.device.type == "cpu"
    assert b.get_buf_infos()[2] == host.get_buf_infos()[2]
    assert b.row_bytes == 15872
    b.output_hidden_states[3].fill_(1.5)
    host.output_hidden_states[3].fill_(1.5)
    assert b.row_checksum(3) == host.row_checksum(3)


def test_intra_node_nvlink_handoffs_verified_over_nvlink(cfg_factory, tmp_path):
    cfg = cfg_factory("mem_pool=INTRA_NODE_NVLINK", "workload.requests=300",
                      "buffers.hidden_size=7168", "buffers.hidden_states_dtype=bfloat16")
    plan = make_plan(cfg, detect())
    assert plan.engine_transport is EngineTransport.nvlink_intra
    out = run_handoffs(cfg, plan, tmp_path)
    res = build_results(300, plan, out)
    print(json.dumps({k: res[k] for k in ("verified", "failed", "effective_transport", "latency_us")}))
    assert (res["verified"], res["failed"], res["corrupted"]) == (300, 0, 0), res
    assert res["effective_transport"] == "mooncake-nvlink_intra"
    decisions = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert {d["transport"] for d in decisions} == {"mooncake-nvlink_intra"}
    assert {d["buffer_device"] for d in decisions} == {"cuda"}


def _trap(conn):
    """nvlink_intra protocol WITHOUT MC_INTRANODE_NVLINK: Mooncake silently runs TCP."""
    from orchestrator.transport.engine import MooncakeEngine

    try:
        eng = MooncakeEngine("127.0.0.1", "P2PHANDSHAKE", "nvlink_intra",
                             env={"MC_INTRANODE_NVLINK": None, "MC_FORCE_TCP": None})
        conn.send(eng.effective_transport.value if eng.effective_transport else None)
    except Exception as exc:  # an engine that does not come up is not NVLink either
        conn.send(f"init failed: {exc}")


def test_presence_trap_is_detected_as_effective_transport():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_trap, args=(child,))
    proc.start()
    assert parent.poll(120)
    effective = parent.recv()
    proc.join(30)
    print("effective transport without MC_INTRANODE_NVLINK:", effective)
    assert effective != "nvlink_intra"


def test_all_pairs_four_by_four_over_nvlink(cfg_factory, tmp_path):
    """experiment=pd_8gpu_nvlink (4 prefill x 4 decode ranks, all pairs) on the GPUs there
    are: GPUs 0-3 -> 4-7 on eight, ranks alternating between GPU 0 and 1 on two."""
    cfg = cfg_factory("experiment=pd_8gpu_nvlink", "workload.requests=200")
    plan = make_plan(cfg, detect())
    out = run_handoffs(cfg, plan, tmp_path)
    res = build_results(800, plan, out)
    print(json.dumps({"pairs": res["pairs"], "effective_transport": res["effective_transport"]}))
    assert (res["verified"], res["failed"], res["corrupted"]) == (800, 0, 0), res
    assert res["effective_transport"] == "mooncake-nvlink_intra"
    assert len(res["pairs"]) == 16
