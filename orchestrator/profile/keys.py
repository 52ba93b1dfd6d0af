"""Every key of the schema (orchestrator.profile.config), dotted, with its type, its default
(the composed conf/ default, what a run without overrides gets) and one line of meaning read
from the schema's own text: the docstring under each field (torchtitan style), else the
comment on the field's line or just above it. `--help` lists them, the did-you-mean of an
unknown key picks from them, and the docs' key tables are checked against them.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Any, Mapping, Optional, Sequence

from orchestrator.profile.config import OrchestratorConfig


@dataclass(frozen=True)
class Key:
    name: str  # dotted: transport.mooncake.transport
    type: str  # int, float, bool, str, an enum's name, list
    doc: str  # one line ("" where the schema says nothing)
    default: Any = None  # the schema's default (keys() fills the composed one)
    choices: tuple[str, ...] = ()  # an enum's values, as typed


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _comment(line: str) -> Optional[str]:
    """The `# ...` comment on one source line, outside strings."""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(line + "\n").readline):
            if tok.type == tokenize.COMMENT:
                return tok.string.lstrip("#").strip()
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    return None


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field: one line}: the string statement right under the field, else the comment at
    the end of its line, else the comment lines right above it."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = src.splitlines()
    node = ast.parse(src).body[0]
    assert isinstance(node, ast.ClassDef)
    out: dict[str, str] = {}
    body = node.body
    for i, st in enumerate(body):
        if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
            continue
        nxt = body[i + 1] if i + 1 < len(body) else None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            out[st.target.id] = _one_line(nxt.value.value)
            continue
        doc = _comment(lines[(st.end_lineno or st.lineno) - 1])
        if doc is None:
            above: list[str] = []
            j = st.lineno - 2
            while j >= 0 and lines[j].strip().startswith("#"):
                above.insert(0, lines[j].strip().lstrip("#").strip())
                j -= 1
            doc = " ".join(above)
        out[st.target.id] = _one_line(doc)
    return out


def _type_name(t: Any) -> str:
    if isinstance(t, type):
        return t.__name__
    text = str(t).replace("typing.", "")
    return text.replace("Optional[", "").rstrip("]") if text.startswith("Optional[") else text


def _walk(cls: type, prefix: str) -> list[Key]:
    import typing

    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out: list[Key] = []
    for f in dataclasses.fields(cls):
        t = hints.get(f.name, f.type)
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            out += _walk(t, f"{prefix}{f.name}.")
        elif sub is not None and isinstance(sub, type) and dataclasses.is_dataclass(sub):
            out += _walk(sub, f"{prefix}{f.name}.")
        else:
            default = f.default if f.default is not dataclasses.MISSING else None
            enum = next((a for a in (t, *typing.get_args(t)) if isinstance(a, type) and issubclass(a, Enum)), None)
            choices = tuple(m.name for m in enum) if enum is not None else ()
            out.append(Key(f"{prefix}{f.name}", _type_name(t), docs.get(f.name, ""), default, choices))
    return out


@lru_cache(maxsize=None)
def schema_keys() -> tuple[Key, ...]:
    """Every key, in the schema's order, with the schema's defaults."""
    return tuple(_walk(OrchestratorConfig, ""))


def value_text(value: Any) -> str:
    """A value as a user would type it on the command line."""
    if isinstance(value, Enum):
        return value.name
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        if value and dataclasses.is_dataclass(value[0]):
            return f"[{len(value)} entries]"
        return "[" + ",".join(value_text(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return f"{value:.1f}"
    return str(value)


def keys(defaults: Mapping[str, Any]) -> list[Key]:
    """Every key with its default in `defaults` (dotted key -> value: the composed conf/ with
    no overrides, preflight.compose.composed_defaults, for --help)."""
    return [dataclasses.replace(k, default=defaults[k.name]) for k in schema_keys()]


def first_sentence(text: str) -> str:
    """The first sentence of a field's doc (what fits one line of --help)."""
    for i in range(len(text) - 2):
        if text[i] == "." and text[i + 1] == " " and text[i + 2].isupper() and not text[:i].endswith(("e.g", "i.e")):
            return text[:i + 1]
    return text


def help_text(every: Sequence[Key]) -> str:
    """The `--help` section for `every` key (keys()): one line per key,
    `key=default  meaning [choices]`."""
    rows = []
    for k in every:
        doc = first_sentence(k.doc)
        if k.choices and not all(c in doc for c in k.choices):  # unless the doc names them
            doc = (doc + " " if doc else "") + f"[{', '.join(k.choices)}]"
        rows.append((f"{k.name}={value_text(k.default)}", doc))
    col = 40
    lines = ["== Keys (KEY=VALUE: each with its default, then what it decides) =="]
    for left, doc in rows:
        if len(left) + 2 > col and doc:
            lines.append(left)
            left = ""
        lines.append((left.ljust(col) + doc).rstrip())
    return "\n".join(lines)
