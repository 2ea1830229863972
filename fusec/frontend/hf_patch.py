"""Wrapping a transformers method once per process (fusec's HF ``generate()`` hooks)."""
from __future__ import annotations

import functools
from typing import Any, Callable


def wrap_once(owner: Any, name: str, make: Callable[[Callable], Callable]) -> bool:
    """Replace ``owner.<name>`` by ``make(original)`` (given ``functools.wraps(original)``'s name,
    docstring and ``__wrapped__``, and marked ``_fusec``), unless it is absent or already fusec's.

    Args:
        owner: the class or module holding the attribute (``GenerationMixin``, ``PreTrainedModel``).
        name: the attribute, e.g. ``"_sample"``.
        make: builds the wrapper from the original function; the wrapper calls it for what
            fusec does not take.

    Returns whether it wrapped (False: no such attribute, or wrapped before: idempotent).
    """
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_fusec", False):
        return False
    wrapper = functools.wraps(original)(make(original))
    wrapper._fusec = True   # type: ignore[attr-defined]
    setattr(owner, name, wrapper)
    return True
