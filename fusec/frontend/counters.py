"""HF's sliding-window token counters under dynamo: symbolic for ``torch.compile(backend="fusec")``,
specialized for fusec's own one-call captures.

HF's ``StaticSlidingWindowLayer`` (transformers 5) counts the tokens it has seen in a Python int
(``cumulative_length_int``); dynamo specializes on such an int unless its source is listed in
``torch.compiler.config.dynamic_sources``. The backend keeps the counter symbolic (one kernel for
every value, the host computes it per call: :mod:`fusec.frontend.host_scalars`); a capture of one
call that does not split host scalars wants its concrete value.
"""
from __future__ import annotations

from typing import Any

import torch

#: dynamo source names of the Python ints HF's sliding-window cache layers count tokens in
#: (``StaticSlidingWindowLayer.cumulative_length_int``, transformers 5)
CACHE_COUNTER_SOURCES = r".*\.cumulative_length_int$"


def mark_cache_counters_dynamic() -> None:
    """Have dynamo trace HF's sliding-window token counters as symbolic ints from the first
    call (``torch.compiler.config.dynamic_sources``, a regex of source names), so a model with
    sliding-window layers (Gemma-2/3, Mistral) is traced and compiled once: with the counter
    specialized, the first decode call compiled a step for its one value and the second call
    compiled again with the counter symbolic (two fusec compiles per process, measured on
    Gemma-2-2B). :mod:`fusec.frontend.backend` calls it when it is imported (``torch.compile``
    looks up ``backend="fusec"`` before it traces); it appends to what the user set there and touches
    only sources named ``....cumulative_length_int``."""
    cfg = torch.compiler.config
    have = [s for s in cfg.dynamic_sources.replace(" ", "").split(",") if s]
    if CACHE_COUNTER_SOURCES not in have:
        cfg.dynamic_sources = ",".join(have + [CACHE_COUNTER_SOURCES])


def counters_specialized() -> Any:
    """A context in which dynamo specializes HF's sliding-window token counters again (the
    setting :func:`mark_cache_counters_dynamic` made, taken out of
    ``torch.compiler.config.dynamic_sources`` while it lasts). For captures of ONE call that
    handle no host scalars (:func:`fusec.api.compile_model`, the CLI): with the counter symbolic
    their graph would carry a size that is not a KV cache's length (NotLengthPolymorphic)."""
    cfg = torch.compiler.config
    keep = [s for s in cfg.dynamic_sources.replace(" ", "").split(",") if s and s != CACHE_COUNTER_SOURCES]
    return cfg.patch(dynamic_sources=",".join(keep))
