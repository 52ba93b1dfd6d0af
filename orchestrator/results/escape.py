"""Peer-supplied strings on the console, escaped as results.json and the logs escape them.

A split run's peer sends strings that this side shows: its versions, the address SGLang
would advertise on its host (SGLANG_HOST_IP, taken as it is), a refusal's reason. On a
terminal, a control character in one acts: ESC starts an escape sequence, and CR/LF starts
a line, which can forge one of the summary's (`fake: verified 200, corrupted 0`, issue 36).
results.json and the JSON logs escape them (JSON's \\u001b, \\r, \\n); the console shows
them escaped too, as Python's repr writes them (\\x1b, \\r, \\n, \\u2028): every line of the
summary (:func:`printable`) and every console log line (:func:`escape_event`, a structlog
processor) goes through this one helper. This tool's own lines are single printable lines,
which it leaves as they are.
"""

from __future__ import annotations

from typing import Any, MutableMapping

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_KEEP = frozenset({"exception", "stack"})  # a traceback the console formats itself: its lines stay


def _escape(c: str) -> str:
    if c in _NAMED:
        return _NAMED[c]
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def printable(text: str) -> str:
    """`text` with every character that is not printable (C0/C1 controls, DEL, line and
    paragraph separators, format characters such as bidi overrides) written as its escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def escape_event(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor for the console: every string value escaped (other values are
    rendered with repr, which escapes them already)."""
    for key, value in event_dict.items():
        if isinstance(value, str) and key not in _KEEP:
            event_dict[key] = printable(value)
    return event_dict
