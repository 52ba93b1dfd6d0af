"""GPU tests (marker `gpu`, skipped where torch sees no CUDA). Run on the H200 machines:
INTRA_NODE_NVLINK buffers on CUDA, handoffs over Mooncake's intra-node NVLink transport,
digests computed on the GPU."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch

from orchestrator import MetadataBuffers
from orchestrator.handoff.digest import Keys, RowDigest
from orchestrator.handoff.workload import RequestPool, Shapes
from orchestrator.profile.config import MemPoolType, WorkloadConfig
from orchestrator.profile.plan import EngineTransport
from orchestrator.profile.platform import detect

from .test_digest import flipped_byte_sweep

pytestmark = pytest.mark.gpu


def test_intra_node_nvlink_buffers_live_on_cuda_with_sglang_layout():
    b = MetadataBuffers(8, 7168, torch.bfloat16, 64, mem_pool=MemPoolType.INTRA_NODE_NVLINK)
    host = MetadataBuffers(8, 7168, torch.bfloat16, 64)
    assert b.device.type == "cuda" and host.device.type == "cpu"
    assert b.get_buf_infos()[2] == host.get_buf_infos()[2]
    assert b.row_bytes == 15872
    fresh = b.arena.clone()
    b.warm()  # the start-up warm-up writes zeros where fresh rows hold zeros
    assert torch.equal(fresh, b.arena)
    pool = RequestPool(WorkloadConfig(),
                       Shapes(7168, torch.bfloat16, device="cuda"), size=4)
    cpu_pool = RequestPool(WorkloadConfig(),
                           Shapes(7168, torch.bfloat16), size=4)
    for slot in range(4):  # SGLang's set_buf on CUDA rows, then the GPU digest == the host one
        b.set_buf(pool.get(slot, slot))
        host.set_buf(cpu_pool.get(slot, slot))
    keys = Keys(b"gpu")
    idents = [(0, s) for s in range(4)]
    digest = RowDigest(b, keys)
    before = b.arena.clone()
    digest.warm()  # every batch shape, reads only
    assert torch.equal(before, b.arena)
    assert digest.sign(range(4), idents) == RowDigest(host, keys).sign(range(4), idents)
    assert b.room(2) == host.room(2) != 0


def test_any_single_flipped_byte_is_caught_on_the_gpu():
    assert flipped_byte_sweep("cuda") > 6 * 1000


def _nvlink_run(run_job, run_dir, *overrides):
    """An INTRA_NODE_NVLINK job on this machine's GPUs, planned onto the NVLink transport."""
    res = run_job(run_dir, "mem_pool=INTRA_NODE_NVLINK", *overrides, platform=detect())
    assert run_job.plan.engine_transport is EngineTransport.nvlink_intra
    print(res.verified, res.failed, res.transports.effective_transport, res.latency_us, res.timing)
    return res


def test_intra_node_nvlink_handoffs_verified_over_nvlink(run_job, tmp_path):
    res = _nvlink_run(run_job, tmp_path, "workload.requests=300", "buffers.hidden_size=7168",
               "buffers.hidden_states_dtype=bfloat16")
    assert (res.verified, res.failed, res.corrupted) == (300, 0, 0), res
    assert res.transports.effective_transport == "mooncake-nvlink_intra"
    decisions = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert {d["transport"] for d in decisions} == {"mooncake-nvlink_intra"}
    assert {d["buffer_device"] for d in decisions} == {"cuda"}
    boots = [json.loads(x) for x in (tmp_path / "prefill.log").read_text().splitlines()
             if '"bootstrapped"' in x]
    print("first NVLink write (start-up warm-up), us:", [b["first_write_us"] for b in boots])
    assert boots and all(b["first_write_us"] > 0 for b in boots)


def test_coalesced_steps_with_the_digest_in_kv_checksum_over_nvlink(run_job, tmp_path):
    res = _nvlink_run(run_job, tmp_path, "experiment=deepseek_v3_mtp", "workload.requests=4096",
               "workload.batch_size=64", "workload.concurrency=256", "buffers.size=512",
               "transport.coalesce=true", "transport.status=per_step", "buffers.kv_checksum_enabled=true")
    assert (res.verified, res.failed, res.corrupted) == (4096, 0, 0), res
    assert res.timing.sends < 4096 / 4


def _trap(conn):
    """nvlink_intra protocol WITHOUT MC_INTRANODE_NVLINK: Mooncake silently runs TCP."""
    from orchestrator.handoff.backends.mooncake.engine import MooncakeEngine

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


def test_all_pairs_four_by_four_over_nvlink(run_job, tmp_path):
    """experiment=pd_8gpu_nvlink (4 prefill x 4 decode ranks, all pairs) on the GPUs there
    are: GPUs 0-3 -> 4-7 on eight, ranks alternating between GPU 0 and 1 on two."""
    res = run_job(tmp_path, "experiment=pd_8gpu_nvlink", "workload.requests=200", platform=detect())
    print(res.pairs, res.transports.effective_transport)
    assert (res.verified, res.failed, res.corrupted) == (800, 0, 0), res
    assert res.transports.effective_transport == "mooncake-nvlink_intra"
    assert len(res.pairs) == 16


@pytest.mark.parametrize("mps", ["on", "off"])
def test_prefill_and_decode_on_one_gpu_under_mps_and_without(run_job, tmp_path, mps):
    """Both processes on GPU 0: endpoints.mps=on runs them under the run's own MPS daemon (its
    server serves them; none is left after the run); off time-slices, with one warning line."""
    import shutil

    if mps == "on" and not shutil.which("nvidia-cuda-mps-control"):
        pytest.skip("nvidia-cuda-mps-control is not on PATH")
    res = _nvlink_run(run_job, tmp_path, "workload.requests=300", "endpoints.prefill_gpus=[0]",
                      "endpoints.decode_gpus=[0]", f"endpoints.mps={mps}")
    assert (res.verified, res.failed, res.corrupted) == (300, 0, 0), res
    sharing = res.transports.gpu_sharing
    print(sharing, res.ending.warnings)
    assert sharing["shared"] == {"0": ["prefill", "decode"]}
    warned = [w for w in res.ending.warnings if "endpoints.mps" in w]
    if mps == "on":
        assert sharing["mps"] and sharing["daemon"] == "own" and sharing["servers"], sharing
        assert not warned
        try:  # (a zombie no one reaps counts as gone)
            state = open(f"/proc/{sharing['daemon_pid']}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        assert state in ("gone", "Z"), "the run's MPS daemon outlived it"
    else:
        assert not sharing["mps"] and len(warned) == 1
