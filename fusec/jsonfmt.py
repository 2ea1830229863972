"""Compact JSON for large artifacts (``schedule.json``): line breaks only at the top levels.

``json.dumps(obj, indent=1)`` puts every element on its own line: the Llama-3.2-1B's schedule.json
was 26 MB, mostly one number per line. :func:`dumps` breaks lines only in the outer ``levels``
containers and writes everything deeper on one line without spaces, so a schedule is one line
per top-level key's element: per instruction, per op, per buffer, per SM queue. The result is
ordinary JSON (``json.loads`` reads it back to the same object).
"""
from __future__ import annotations

import json
from typing import Any

_COMPACT = (",", ":")


def _key(k: Any) -> str:
    """A dict key as json.dumps writes it (non-string keys become strings)."""
    return json.dumps({k: 0}, separators=_COMPACT)[1:-3]


def dumps(obj: Any, levels: int = 2, _depth: int = 0) -> str:
    """``obj`` as JSON with one element per line in the outer ``levels`` dicts and lists (indented
    by one space per level) and each deeper value on one line, without spaces."""
    if levels <= 0 or not isinstance(obj, (dict, list)) or not obj:
        return json.dumps(obj, separators=_COMPACT)
    pad = " " * (_depth + 1)
    if isinstance(obj, dict):
        items = [f"{pad}{_key(k)}: {dumps(v, levels - 1, _depth + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * _depth + "}"
    items = [pad + dumps(v, levels - 1, _depth + 1) for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + " " * _depth + "]"
