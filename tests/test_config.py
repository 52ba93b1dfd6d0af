"""Config composition (Hydra compose API) and user mistakes on the real command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from orchestrator.profile.config import ConfigError, MemPoolType, RouteSetting, validate

from .conftest import CONF, ROOT, compose_cfg


def test_default_is_cpu_engine_profile(cfg_factory):
    cfg = cfg_factory()
    assert cfg.mem_pool.type is MemPoolType.NONE
    assert cfg.transport.route is RouteSetting.auto
    assert cfg.transport.host == "127.0.0.1"
    assert cfg.workload.requests >= 1000


@pytest.mark.parametrize("pool", [p.stem for p in sorted((CONF / "mem_pool").glob("*.yaml"))])
def test_every_mem_pool_profile_composes(cfg_factory, pool):
    assert cfg_factory(f"mem_pool={pool}").mem_pool.type is MemPoolType[pool]


def test_each_pool_has_a_profile():
    assert {p.stem for p in (CONF / "mem_pool").glob("*.yaml")} == {p.name for p in MemPoolType}


@pytest.mark.parametrize("override", [
    "mem_pool=FOO", "transport.route=bogus", "transport.fallback=maybe", "buffers.sise=3",
    "buffers.size=abc", "buffers.hidden_states_dtype=int4", "transport.mooncake.transport=nvlink",
])
def test_hydra_rejects(override):
    with pytest.raises(ConfigCompositionException):
        compose_cfg(override)


@pytest.mark.parametrize("override,key", [
    ("buffers.size=0", "buffers.size"),
    ("buffers.hidden_size=-1", "buffers.hidden_size"),
    ("workload.requests=-5", "workload.requests"),
    ("workload.concurrency=0", "workload.concurrency"),
    ("transport.timeout_s=0", "transport.timeout_s"),
    ("transport.host=localhost.example", "transport.host"),
    ("transport.mooncake.metadata_server=nowhere", "transport.mooncake.metadata_server"),
    ("workload.top_logprobs_num=500", "workload.top_logprobs_num"),
    ("+buffers.extra=1", "buffers.extra"),
    ("endpoints.decode_gpus=[-2]", "endpoints.decode_gpus"),
    ("endpoints.prefill_gpus=[0,1]", "endpoints.prefill_gpus"),
])
def test_validate_names_key(override, key):
    with pytest.raises(ConfigError) as info:
        validate(compose_cfg(override))
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}=")


def _cli(*overrides: str) -> subprocess.CompletedProcess:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # a test writes nothing into the checkout
        return subprocess.run([sys.executable, "-m", "orchestrator", *overrides,
                               "hydra.run.dir=" + str(Path(tmp) / "run")],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("override,needle", [
    ("buffers.size=0", "buffers.size=0 is not allowed"),
    ("workload.requests=-1", "workload.requests=-1 is not allowed"),
    ("mem_pool=FOO", "Could not find 'mem_pool/FOO'"),
    ("transport.route=bogus", "expected one of [auto, tcp, engine]"),
    ("buffers.sise=3", "Key 'sise' not in 'BuffersConfig'"),
    ("buffers.sise=3", "did you mean buffers.size?"),
    ("workload.concurency=3", "did you mean workload.concurrency?"),
])
def test_cli_user_error_exits_nonzero_without_traceback(override, needle):
    proc = _cli(override)
    assert proc.returncode != 0
    assert needle in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "+buffers" not in proc.stderr and "To append" not in proc.stderr  # Hydra's hint leads nowhere


def test_every_config_field_has_a_docstring_under_it():
    """torchtitan style: each section a docstring, each field a docstring on the next line."""
    import ast

    import orchestrator.profile.config as schema

    tree = ast.parse(Path(schema.__file__).read_text())
    missing = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")):
        if ast.get_docstring(cls) is None:
            missing.append(cls.name)
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str)):
                    missing.append(f"{cls.name}.{node.target.id}")
    assert missing == []
