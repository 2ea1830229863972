"""Every fusec option and environment variable, typed, in one place.

Options reach the backend as ``torch.compile(..., options={...})``; environment variables
give defaults: ``FUSEC_DUMP`` (folder: dump every stage's artifact), ``FUSEC_CACHE_DIR``
(NVRTC CUBIN cache and, under ``artifacts/``, the artifact cache), ``FUSEC_NUM_SMS``,
``FUSEC_FALLBACK``, ``FUSEC_MAX_FUSIONS``,
``FUSEC_PROFILE`` (folder: record and write the per-SM timeline, as ``profile_dir``),
``FUSEC_DEFINES`` (``NAME=VALUE,...``: kernel tuning macros, as ``defines``),
``FUSEC_ATTENTION_MERGE`` (as ``attention_merge``), ``FUSEC_CACHE`` (``0``: no artifact
cache, as ``cache=False``), ``FUSEC_CACHE_MAX_MB`` (as ``cache_max_mb``).
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from fusec.errors import FusecError

TARGETS = ("sim", "cuda")
FALLBACKS = ("inductor", "eager")
ATTENTION_MERGES = ("last_tile", "reduce")
#: option -> the environment variable that gives its default (module docstring)
ENV_VARS = {"dump_dir": "FUSEC_DUMP", "num_sms": "FUSEC_NUM_SMS", "fallback": "FUSEC_FALLBACK",
            "max_fusions": "FUSEC_MAX_FUSIONS", "attention_merge": "FUSEC_ATTENTION_MERGE",
            "profile_dir": "FUSEC_PROFILE", "cache": "FUSEC_CACHE",
            "cache_max_mb": "FUSEC_CACHE_MAX_MB", "defines": "FUSEC_DEFINES"}
#: the integer ones, with their smallest value
_ENV_INT_MIN = {"num_sms": 1, "max_fusions": 0, "cache_max_mb": 0}
#: the spellings of a boolean environment variable (``FUSEC_CACHE``)
_BOOLS = {"0": False, "false": False, "no": False, "off": False,
          "1": True, "true": True, "yes": True, "on": True}
#: ``torch.compile``'s ``mode`` (HF ``CompileConfig`` passes "reduce-overhead" by default) and
#: what it means to fusec: whether the step's launch is replayed from a CUDA graph fusec records
#: itself (fewer microseconds of Python and driver work per step) or launched directly.
#: the capacity of a length-polymorphic step when ``max_cache_len`` is not set (rows of the
#: position tables: 8 MiB of RoPE cos/sin for Llama-3.2-1B's head_dim 64 in bf16)
DEFAULT_MAX_CACHE_LEN = 32768

MODES = {None: False, "default": False, "reduce-overhead": True, "max-autotune": True,
         "max-autotune-no-cudagraphs": False}


def _env_int(name: str, minimum: int) -> int:
    """The environment variable ``name`` as an integer of at least ``minimum``.

    Raises:
        FusecError: it is not one (the message names the variable and its value).
    """
    text = os.environ[name]
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise FusecError(f"{name}={text!r}: expected an integer >= {minimum}")
    return value


@dataclasses.dataclass
class Options:
    """Compilation options.

    Attributes:
        target: "sim" (CPU simulator) or "cuda"; None follows the model's tensors.
        num_sms: SMs (CTAs) to schedule for; None: the GPU's SM count for a CUDA step compiled through
            ``torch.compile`` (the model's device), else 132 (an H200).
        dump_dir: folder for stage artifacts (captured graph, IR per pass, schedule.json).
        fallback: backend for graphs fusec cannot place: "inductor" (where it works) or "eager".
        seed: seed of the simulator's interleaving.
        check_hazards: run the simulator's hazard check every step.
        max_fusions: apply at most this many fusions (bisecting); None = all.
        bandwidth: bytes/s used to predict step time from bytes (4.3e12: H200 measured read).
        watchdog_s: GPU counter waits give up after this many seconds (WatchdogError).
        check_watchdog: before every GPU step, read the status the kernel writes to host-mapped
            memory (a plain memory read: no sync, no copy; capturable) and raise what an earlier
            step recorded: WatchdogError (counters reset) or IndexFaultError (record cleared).
            A fault therefore raises at the NEXT call. Off, only ``raise_if_watchdog()`` on the
            step (which synchronizes first) reports.
        profile: GPU only: build the kernel with per-instruction timestamps and write the per-SM
            timeline (``trace.json`` for ui.perfetto.dev, ``timeline.json``, ``timeline.png``)
            into ``profile_dir`` after step number ``profile_step`` (1-based).
        profile_dir: where the timeline goes (default ``fusec_profile``); setting it implies profile.
        profile_step: which step to record (later steps overwrite nothing).
        attention_merge: how the split-KV partials of a KV head are merged: "last_tile" (the
            split-KV tile that finishes last, found with an atomic ticket, merges its group) or
            "reduce" (a separate ``attention_reduce`` level after all partial tiles). The default
            "last_tile" measured 1.0-1.4% faster on the H200 (docs/performance.md section 8).
        defines: ``#define`` name -> value for the kernel source: the tuning knobs of
            :data:`fusec.cuda.knobs.KNOBS` (``FUSEC_LOADS_IN_FLIGHT``, ``FUSEC_PREFETCH``)
            and their defaults.
        mode: ``torch.compile``'s mode, passed by torch as a backend keyword: None or "default"
            and "max-autotune-no-cudagraphs" launch the kernel directly each step;
            "reduce-overhead" (HF generate()'s default) and "max-autotune" replay the launch
            from a CUDA graph that fusec records itself (:data:`MODES`). fusec does no
            autotuning: the two max-autotune modes equal the other two.
        cache: keep the lowered schedule and the rendered kernel in the artifact cache
            (``FUSEC_CACHE_DIR/artifacts``, :mod:`fusec.runtime.artifacts`), so that another
            process compiling the same graph skips the passes and the rendering.
        cache_max_mb: size cap of the artifact cache folder in MiB (least recently used
            entries are removed first).
        max_cache_len: the longest KV cache (rows) one compiled step serves when its graph's cache
            length is symbolic (dynamo's dynamic shapes, ``fusec.generate``): the position tables
            (RoPE cos/sin) are built for positions ``[0, max_cache_len)``. None: the larger of
            :data:`DEFAULT_MAX_CACHE_LEN` and the first call's cache length rounded up to a power
            of two. A call with a longer cache builds the step again for twice the length.
    """

    target: str | None = None
    num_sms: int | None = None
    dump_dir: str | None = None
    fallback: str = "inductor"
    seed: int = 0
    check_hazards: bool = True
    max_fusions: int | None = None
    bandwidth: float = 4.3e12
    watchdog_s: float = 2.0
    check_watchdog: bool = True
    profile: bool = False
    profile_dir: str | None = None
    profile_step: int = 3
    attention_merge: str = "last_tile"
    defines: dict[str, Any] = dataclasses.field(default_factory=dict)
    mode: str | None = None
    cache: bool = True
    cache_max_mb: int = 4096
    max_cache_len: int | None = None

    @property
    def graph_launch(self) -> bool:
        """True when the step's launch is replayed from a CUDA graph (``mode``)."""
        return MODES[self.mode]

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "Options":
        """Options from a dict over the environment defaults; unknown keys are an error."""
        env: dict[str, Any] = {}
        for key, var in ENV_VARS.items():
            text = os.environ.get(var)
            if not text:
                continue
            if key in _ENV_INT_MIN:
                env[key] = _env_int(var, _ENV_INT_MIN[key])
            elif key == "cache":
                if text.strip().lower() not in _BOOLS:
                    raise FusecError(f"{var}={text!r}: expected 0 or 1")
                env[key] = _BOOLS[text.strip().lower()]
            elif key == "defines":
                try:
                    env[key] = dict(kv.split("=", 1) for kv in text.split(",") if kv)
                except ValueError:
                    raise FusecError(f"{var}={text!r}: expected NAME=VALUE,...") from None
            else:
                env[key] = text
        d = {**env, **(d or {})}

        def via(key: str) -> str:
            """' (from ENV_VAR)' when the value came from the environment."""
            return f" (from {ENV_VARS[key]})" if key in env and d.get(key) is env[key] else ""
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - names)
        if bad:
            raise FusecError(f"unknown fusec option(s) {bad}; known: {sorted(names)}")
        for key in ("num_sms", "max_fusions", "seed", "profile_step", "cache_max_mb", "max_cache_len"):
            if d.get(key) is not None and (not isinstance(d[key], int) or isinstance(d[key], bool)):
                raise FusecError(f"option {key}={d[key]!r} must be an int")
        o = cls(**d)
        if o.target is not None and o.target not in TARGETS:
            raise FusecError(f"option target={o.target!r} must be one of {TARGETS}")
        if o.fallback not in FALLBACKS:
            raise FusecError(f"option fallback={o.fallback!r}{via('fallback')} must be one of {FALLBACKS}")
        if o.attention_merge not in ATTENTION_MERGES:
            raise FusecError(f"option attention_merge={o.attention_merge!r}{via('attention_merge')} must be one of {ATTENTION_MERGES}")
        if o.mode not in MODES:
            raise FusecError(f"option mode={o.mode!r} must be one of {list(MODES)}")
        if not isinstance(o.cache, bool):
            raise FusecError(f"option cache={o.cache!r} must be a bool")
        if o.cache_max_mb < 0:
            raise FusecError(f"option cache_max_mb={o.cache_max_mb} must be >= 0")
        if o.max_cache_len is not None and not 1 <= o.max_cache_len <= 1 << 24:
            raise FusecError(f"option max_cache_len={o.max_cache_len} must be in [1, {1 << 24}]")
        if o.num_sms is not None and o.num_sms < 1:
            raise FusecError(f"option num_sms={o.num_sms} must be >= 1")
        if o.profile_dir is not None and (d.get("profile") is not False):
            o.profile = True
        if o.profile_step < 1:
            raise FusecError(f"option profile_step={o.profile_step} must be >= 1")
        if not isinstance(o.defines, dict):
            raise FusecError(f"option defines={o.defines!r} must be a dict of NAME -> value")
        values = {}
        for k, v in o.defines.items():
            if not (isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)):
                raise FusecError(f"option defines{via('defines')}: {k!r} is not a C macro name")
            # every kernel knob is an int (fusec.cuda.knobs); a token such as "abc" would reach
            # NVRTC as an undefined identifier, or silently nothing without --emit-cuda
            text = str(v).strip() if isinstance(v, str) else None
            if isinstance(v, bool) or not (isinstance(v, int) or (text and re.fullmatch(r"[-+]?\d+", text))) \
                    or not -2 ** 31 <= int(v) < 2 ** 31:
                raise FusecError(f"option defines{via('defines')}: {k}={v!r} must be an integer "
                                 f"(a 32-bit int: kernel knobs are #defined ints)")
            values[k] = int(v)
        o.defines = values
        if o.defines:
            from fusec.cuda.knobs import KNOBS   # the kernel's knobs (a misspelt one would do nothing)
            unknown = sorted(set(o.defines) - set(KNOBS))
            if unknown:
                raise FusecError(f"option defines{via('defines')}: unknown kernel knob(s) {unknown}; "
                                 f"known: {sorted(KNOBS)}")
        return o
