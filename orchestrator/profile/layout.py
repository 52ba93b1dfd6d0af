"""Aux layouts as declared data: conf/layout/<name>.yaml lists the fields of one SGLang
release (name, dtype, row width, presence condition, fill value, role). This module turns a
declaration plus the buffer sizes into the concrete field list MetadataBuffers allocates, and
into the fingerprint both sides exchange at bootstrap, so a prefill and a decode built from
different layouts are refused before any byte moves (SGLang's receiver would write a
mismatched payload wherever field index and slot point, with no bounds check).

Supporting the next SGLang release means adding one YAML file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence, Union

import yaml

from orchestrator.profile.config import CONF_DIR, LAYOUT_DTYPES, BuffersConfig, FieldConfig, LayoutConfig

if TYPE_CHECKING:
    import torch

LAYOUT_DIR = CONF_DIR / "layout"
DEFAULT_LAYOUT = "sglang_0_5_23"

# Bytes per element of each dtype name a layout may declare (torch spells the names alike:
# torch.<name>). Sizes and the bootstrap description are computed from this table, so the
# rule book, doctor and the parent never import torch; torch's dtype is looked up only where
# tensors are made (field_specs).
ITEMSIZE = {"int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "uint64": 8, "float16": 2,
            "bfloat16": 2, "float32": 4, "float64": 8}
assert set(ITEMSIZE) == set(LAYOUT_DTYPES)


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # torch's dtype for each name (imports torch)
        import torch

        return {n: getattr(torch, n) for n in LAYOUT_DTYPES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: Union[str, "torch.dtype"]) -> str:
    """float32 for torch.float32 or "float32" (no torch import)."""
    return str(dtype).removeprefix("torch.")


class FieldDeclaration(Protocol):
    """One declared field, as the functions below read it: a FieldConfig, or the frozen copy
    an endpoint's spec holds (orchestrator.handoff.specs.LayoutField)."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def width(self) -> str: ...

    @property
    def present(self) -> str: ...

    @property
    def fill(self) -> int: ...

    @property
    def role(self) -> str: ...

    @property
    def get_buf(self) -> bool: ...


class Declaration(Protocol):
    """A layout declaration: a LayoutConfig, or the frozen copy an endpoint's spec holds
    (orchestrator.handoff.specs.LayoutSpec)."""

    @property
    def name(self) -> str: ...

    @property
    def fields(self) -> Sequence[FieldDeclaration]: ...


@dataclass(frozen=True)
class Sizes:
    """What the MetadataBuffers constructor was given (SGLang's arguments)."""

    hidden_size: int
    hidden_states_dtype: Union[str, "torch.dtype"]  # a name (float32) or torch's dtype
    max_sampling_mask_tokens: int
    max_top_logprobs_num: int = 128
    output_dsa_topk_indices_dim: int = 0
    kv_checksum_enabled: bool = False
    enable_sampling_mask: bool = False

    def present(self, condition: str) -> bool:
        return {"always": True, "sampling_mask": self.enable_sampling_mask,
                "dsa": self.output_dsa_topk_indices_dim > 0,
                "kv_checksum": self.kv_checksum_enabled}[condition]


@dataclass(frozen=True)
class FieldSpec:
    name: str
    width: int
    dtype: "torch.dtype"
    fill: int = 0
    role: str = ""
    get_buf: bool = True

    @property
    def item_len(self) -> int:
        return self.width * self.dtype.itemsize


def load_layout(name: str = DEFAULT_LAYOUT) -> LayoutConfig:
    """A layout declaration from conf/layout/<name>.yaml (outside Hydra: SGLang-style code
    that builds MetadataBuffers by hand gets the default release's layout)."""
    path = LAYOUT_DIR / f"{name}.yaml"
    data = yaml.safe_load(path.read_text())
    fields = [_field(f) for f in data["fields"]]
    layout = LayoutConfig(name=data["name"], sglang_version=str(data.get("sglang_version", "")),
                          fields=fields)
    layout.check()
    return layout


def _field(raw: dict[str, Any]) -> FieldConfig:
    kwargs: dict[str, Any] = {k: (str(v) if k == "width" else v) for k, v in raw.items()}
    return FieldConfig(**kwargs)


def field_rows(layout: Declaration, sizes: Sizes) -> list[tuple[FieldDeclaration, int, str]]:
    """The PRESENT fields, in declaration order (= get_buf_infos order): the declaration, its
    row width and its dtype name (without torch)."""
    out = []
    for f in layout.fields:
        if not sizes.present(f.present):
            continue
        width = int(f.width) if f.width.isdigit() else int(getattr(sizes, f.width))
        if width <= 0:
            continue
        out.append((f, width, dtype_name(sizes.hidden_states_dtype) if f.dtype == "hidden" else f.dtype))
    return out


def row_bytes(layout: Declaration, sizes: Sizes) -> list[int]:
    """Each present field's row length in bytes (field_rows' order), without torch."""
    return [width * ITEMSIZE[name] for _f, width, name in field_rows(layout, sizes)]


def field_specs(layout: Declaration, sizes: Sizes) -> list[FieldSpec]:
    """The PRESENT fields, in declaration order (= get_buf_infos order), with torch's dtypes."""
    import torch

    return [FieldSpec(f.name, width, getattr(torch, name), f.fill, f.role, f.get_buf)
            for f, width, name in field_rows(layout, sizes)]


def get_buf_names(layout: Declaration) -> list[str]:
    """The fields get_buf() returns, present or not (None for an absent one)."""
    return [f.name for f in layout.fields if f.get_buf]


# ---- cross-layout safety ---------------------------------------------------------------------
def describe(specs: Sequence[FieldSpec]) -> list[list[Any]]:
    """What both sides must agree on, field by field: name, dtype, item length."""
    return [[s.name, dtype_name(s.dtype), s.item_len] for s in specs]


def profile_layout(buffers: BuffersConfig, layout: LayoutConfig) -> list[list[Any]]:
    """The description a profile's buffers will send at bootstrap, computed without
    building them."""
    b = buffers
    sizes = Sizes(b.hidden_size, b.hidden_states_dtype.value, b.max_sampling_mask_tokens, b.max_top_logprobs_num,
                  b.output_dsa_topk_indices_dim, b.kv_checksum_enabled, b.enable_sampling_mask)
    return [[f.name, name, width * ITEMSIZE[name]] for f, width, name in field_rows(layout, sizes)]


def fingerprint(description: list[list[Any]]) -> str:
    blob = json.dumps(description, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


def first_difference(mine: list[list[Any]], theirs: Any) -> Optional[str]:
    """None when the layouts agree, else one sentence naming the first differing field."""
    if not isinstance(theirs, list):
        return "the peer sent no layout description"
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else None
        b: Any = theirs[i] if i < len(theirs) else None
        if a == b:
            continue
        if a is None:
            return f"field {i}: the peer has {b[0]} ({b[1]}, {b[2]} B), this side has no field {i}"
        if b is None:
            return f"field {i}: this side has {a[0]} ({a[1]}, {a[2]} B), the peer has no field {i}"
        return (f"field {i}: this side has {a[0]} ({a[1]}, {a[2]} B), "
                f"the peer has {b[0]} ({b[1]}, {b[2]} B)")
    return None
