"""Every experiment profile composes through Hydra's compose API and plans as documented."""

from __future__ import annotations

import pytest
import torch

from orchestrator.profile.config import ConfigError, MemPoolType
from orchestrator.profile.plan import Device, EngineTransport, Platform

from .conftest import CONF, plan_of

PROFILES = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
CPU = Platform()
TWO_GPU = Platform(cuda_devices=2, mooncake_cuda=True)
ROW_BYTES = {"cpu_smoke": 1600, "llama3_8b": 9728, "deepseek_v3_mtp": 15872,
             "pd_8gpu_nvlink": 15872, "pd_8gpu_tcp": 15872}


def test_profiles_exist():
    assert {"cpu_smoke", "llama3_8b", "deepseek_v3_mtp"} <= set(PROFILES)


@pytest.mark.parametrize("name", PROFILES)
def test_profile_composes_validates_and_documents_itself(cfg_factory, name):
    cfg = cfg_factory(f"experiment={name}")
    text = (CONF / "experiment" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_") and text.count("\n#") >= 2, "say what it models"
    plan = plan_of(cfg, TWO_GPU)
    if cfg.mem_pool.type is MemPoolType.INTRA_NODE_NVLINK:
        assert plan.buffer_device is Device.cuda and plan.engine_transport is EngineTransport.nvlink_intra
    from orchestrator.handoff.endpoints.common import make_buffers

    rows = make_buffers(cfg.buffers, cfg.layout, torch.device("cpu")).row_bytes
    if name in ROW_BYTES:
        assert rows == ROW_BYTES[name]


@pytest.mark.parametrize("name", PROFILES)
def test_profile_on_cpu_box_runs_or_is_refused_clearly(cfg_factory, name):
    cfg = cfg_factory(f"experiment={name}")
    if cfg.mem_pool.type is MemPoolType.INTRA_NODE_NVLINK:
        with pytest.raises(ConfigError, match="transport.fallback=degrade"):
            plan_of(cfg, CPU)
        plan = plan_of(cfg_factory(f"experiment={name}", "transport.fallback=degrade"), CPU)
        assert plan.buffer_device is Device.cpu and plan.events
    else:
        assert plan_of(cfg, CPU).buffer_device is Device.cpu


def test_pd_8gpu_places_prefill_on_0_3_and_decode_on_4_7(cfg_factory):
    plan = plan_of(cfg_factory("experiment=pd_8gpu_nvlink"), Platform(cuda_devices=8, mooncake_cuda=True))
    assert plan.prefill_gpus == (0, 1, 2, 3) and plan.decode_gpus == (4, 5, 6, 7)
    assert plan.engine_transport is EngineTransport.nvlink_intra
    tcp = plan_of(cfg_factory("experiment=pd_8gpu_tcp"), CPU)
    assert tcp.route.value == "tcp" and tcp.buffer_device is Device.cpu


def test_command_line_overrides_beat_the_profile(cfg_factory):
    cfg = cfg_factory("experiment=llama3_8b", "workload.requests=7", "mem_pool=NVLINK")
    assert cfg.workload.requests == 7 and cfg.mem_pool.type is MemPoolType.NVLINK
    assert cfg.buffers.hidden_size == 4096 and cfg.buffers.hidden_states_dtype.value == "bfloat16"
