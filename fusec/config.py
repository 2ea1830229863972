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
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

from fusec.errors import FusecError

TARGETS = ("sim", "cuda")
FALLBACKS = ("inductor", "eager")
ATTENTION_MERGES = ("last_tile", "reduce")
GENERATE_LOOPS = ("device", "hf")
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


#: the largest ``num_sms``: the kernel is one cooperative launch of ``num_sms`` CTAs that must all
#: be resident at once, at most the GPU's SMs x the CTAs one SM holds (2048 threads / 512 per CTA
#: = 4 at most: 528 on an H200); 1024 is above that on any GPU, and the schedule, the simulator's
#: state and the compile time grow with it (``num_sms=10**8`` took 229 s and 17.8 GB on a tiny model)
MAX_NUM_SMS = 1024
#: the most query tokens per sequence a step takes (speculative decoding verifies K <= 8 draft
#: tokens; a longer query is a prefill, which runs eagerly)
MAX_QUERY_TOKENS = 8
#: the most activation rows B·K of a step (B sequences of K query tokens each): what the fused
#: kinds take (``fusec.instructions.matvec_rows.MAX_SEQS``, their ``max_rows``); a larger one runs
#: on the fallback backend (one line) instead of as generic ops on one SM each (docs/batch.md)
MAX_QUERY_ROWS = 16
#: the longest KV cache (rows) and ``max_cache_len``: the position tables grow with it (a step
#: at 2**20 rows: 5 s and 1.5 GB on a tiny model on a 2-core CPU; 2**22 took 65 s and 17.6 GB
#: before the causal-mask proof had a budget). A longer cache runs eagerly (one line);
#: ``fusec.generate`` refuses a prompt plus ``max_new_tokens`` above it
MAX_CACHE_LEN = 1 << 20
#: the largest ``watchdog_s``: the kernel counts it in 64-bit nanoseconds
MAX_WATCHDOG_S = 1e9


def _int(lo: int | None = None, hi: int | None = None, none: bool = False):
    """(check, description) of an int option in ``[lo, hi]`` (a bool is no int here)."""
    def ok(v: Any) -> bool:
        if v is None:
            return none
        return (isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo)
                and (hi is None or v <= hi))
    rng = f" in [{lo}, {hi}]" if lo is not None and hi is not None else f" >= {lo}" if lo is not None else ""
    return ok, f"an int{rng}" + (" or None" if none else "")


def _positive(hi: float | None = None):
    """(check, description) of a float option: a finite number above 0 (an int is accepted)."""
    def ok(v: Any) -> bool:
        return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                and (hi is None or v <= hi))
    return ok, "a finite number > 0" + (f" and <= {hi:g}" if hi is not None else "")


def _bool():
    return (lambda v: isinstance(v, bool)), "True or False (a bool)"


def _choice(choices, none: bool = False):
    def ok(v: Any) -> bool:
        return (v is None and none) or (isinstance(v, str) and v in choices)
    return ok, f"one of {list(choices)}" + (" or None" if none else "")


def _path():
    return (lambda v: v is None or isinstance(v, (str, os.PathLike))), "a folder path (str) or None"


#: option -> (check of its value, what it must be: the error message's end)
_RULES = {
    "target": _choice(TARGETS, none=True),
    "num_sms": _int(1, MAX_NUM_SMS, none=True),
    "dump_dir": _path(),
    "fallback": _choice(FALLBACKS),
    "seed": _int(),
    "check_hazards": _bool(),
    "max_fusions": _int(0, none=True),
    "bandwidth": _positive(),
    "watchdog_s": _positive(MAX_WATCHDOG_S),
    "check_watchdog": _bool(),
    "profile": _bool(),
    "profile_dir": _path(),
    "profile_step": _int(1),
    "attention_merge": _choice(ATTENTION_MERGES),
    "chain": _bool(),
    "prologue": _bool(),
    "mode": _choice([m for m in MODES if m is not None], none=True),
    "cache": _bool(),
    "cache_max_mb": _int(0),
    "max_cache_len": _int(1, MAX_CACHE_LEN, none=True),
    "position_rows": _int(1, MAX_CACHE_LEN, none=True),
    "query_tokens": _int(1, MAX_QUERY_TOKENS),
    "generate_loop": _choice(GENERATE_LOOPS),
}


def _unwritable(folder: str | os.PathLike) -> str | None:
    """None when ``folder`` is, or can be made, a folder that takes a new file (it is created
    here); else the OS error, as ``Type: message``."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


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


def _opt(default: Any, lowering: Callable[[Any], Any] | None = None,
         factory: Callable[[], Any] | None = None) -> Any:
    """A field of :class:`Options` that declares whether it changes lowering or rendering.

    ``lowering``: None for an option that changes neither the schedule nor the kernel source
    (run time, simulator, logging and cache housekeeping); else the function that turns its value
    into the JSON-able part of the artifact key (:func:`lowering_options`). Every field must
    say: :class:`Options` refuses a field without it at import, so a new option cannot be left
    out of the key by omission (a stale step from the cache)."""
    meta = {"lowering": lowering}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class Options:
    """Compilation options.

    Attributes:
        target: "sim" (CPU simulator) or "cuda"; None follows the model's tensors.
        num_sms: SMs (CTAs) to schedule for; None: the GPU's SM count for a CUDA step compiled through
            ``torch.compile`` (the model's device), else 132 (an H200).
        dump_dir: folder for stage artifacts (captured graph, IR per pass, schedule.json). It is
            created when the options are read, and one that cannot take a file (a path under a
            file, a read-only folder) is a FusecError then, naming it and the OS error: fusec
            neither falls back nor compiles without the dump.
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
        chain: run small standalone ops that depend on each other (a norm, RoPE, a cast, a KV
            write, a residual add outside the fused kinds) as one instruction per sequence on
            one CTA (:mod:`fusec.passes.chain`) instead of one dependency level each. False
            keeps one instruction per op (for measuring the difference); so does a set
            ``max_fusions`` (bisecting the fusions).
        prologue: fold the small vector ops in front of a matvec kind (a post-norm and its
            residual add, a scaled residual, an embedding scale) into that kind, each of its tiles
            computing them in its shared memory (:mod:`fusec.passes.prologue`), instead of a
            dependency level of their own. False keeps them (for measuring the difference); so
            does a set ``max_fusions``.
        defines: ``#define`` name -> value for the kernel source: the tuning knobs of
            :data:`fusec.cuda.knobs.KNOBS` (``FUSEC_LOADS_IN_FLIGHT``, ``FUSEC_ATTN_SINGLE``)
            and their defaults.
        mode: ``torch.compile``'s mode, passed by torch as a backend keyword: None or "default"
            and "max-autotune-no-cudagraphs" launch the kernel directly each step;
            "reduce-overhead" (HF generate()'s default) and "max-autotune" replay the launch
            from a CUDA graph that fusec records itself (:data:`MODES`). fusec does no
            autotuning: the two max-autotune modes equal the other two.
        cache: keep the lowered schedule and the rendered kernel in the artifact cache
            (``FUSEC_CACHE_DIR/artifacts``, :mod:`fusec.cache.artifacts`), so that another
            process compiling the same graph skips the passes and the rendering.
        cache_max_mb: size cap of the artifact cache folder in MiB (least recently used
            entries are removed first).
        max_cache_len: the longest KV cache (rows) one compiled step serves when its graph's cache
            length is symbolic (dynamo's dynamic shapes, ``fusec.generate``): the position tables
            (RoPE cos/sin) are built for positions ``[0, max_cache_len)``. None: the larger of
            :data:`DEFAULT_MAX_CACHE_LEN` and the first call's cache length rounded up to a power
            of two. A call with a longer cache builds the step again for twice the length.
        position_rows: positions the position tables (RoPE cos/sin) cover at least, ``[0, rows)``;
            None: the KV caches' rows. The backend sets it for a graph whose positions the host
            computes (HF's sliding-window caches: a rolled window's positions pass every
            cache's rows) to ``max_cache_len`` or :data:`DEFAULT_MAX_CACHE_LEN`; a call past it
            runs eagerly (one line).
        query_tokens: the most query tokens per sequence a compiled step takes (K, at most
            :data:`MAX_QUERY_TOKENS`): 1, a decode step of one new token per sequence; K > 1, the
            verification step of speculative decoding (docs/batch.md), of at most
            :data:`MAX_QUERY_ROWS` rows B·K (more run eagerly, one line). Default 1: a K-token
            step takes its linears as batched matvecs of B·K rows and its attention as split-KV
            tiles, but RoPE and the KV writes stay generic (not yet timed on the GPU), and a short
            prefill through the compiled model (which has the same graph) is a prefill, which
            the fallback backend runs better; with 1 it falls back as before.
        generate_loop: HF ``generate()`` with a fusec ``CompileConfig`` (its ``options``): "device"
            runs greedy search without logits processors as :func:`fusec.generate`'s device loop
            (:mod:`fusec.frontend.hf_device_loop`: no host work per token); "hf" keeps
            transformers' Python loop, which calls the compiled step once per token. Other
            calls (sampling, logits processors, ...) take HF's loop either way.
    """

    target: str | None = _opt(None)
    num_sms: int | None = _opt(None, lowering=lambda v: v or 132)   # 132 (an H200) when unset
    dump_dir: str | None = _opt(None)
    fallback: str = _opt("inductor")
    seed: int = _opt(0)
    check_hazards: bool = _opt(True)
    max_fusions: int | None = _opt(None, lowering=lambda v: v)
    bandwidth: float = _opt(4.3e12)
    watchdog_s: float = _opt(2.0)          # a launch argument, not in the kernel source
    check_watchdog: bool = _opt(True)
    profile: bool = _opt(False, lowering=bool)
    profile_dir: str | None = _opt(None)
    profile_step: int = _opt(3)
    attention_merge: str = _opt("last_tile", lowering=lambda v: v)
    chain: bool = _opt(True, lowering=bool)
    prologue: bool = _opt(True, lowering=bool)
    defines: dict[str, Any] = _opt(None, factory=dict,
                                   lowering=lambda v: sorted((str(k), str(x)) for k, x in v.items()))
    mode: str | None = _opt(None)
    cache: bool = _opt(True)
    cache_max_mb: int = _opt(4096)
    max_cache_len: int | None = _opt(None)   # the IR's capacity: in the captured graph's key already
    position_rows: int | None = _opt(None, lowering=lambda v: v)
    query_tokens: int = _opt(1)   # which graphs capture accepts: in the captured graph's key already
    generate_loop: str = _opt("device")   # HF generate()'s loop, not the step

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
        o = cls(**d)
        for key, (ok, must) in _RULES.items():
            value = getattr(o, key)
            if not ok(value):
                raise FusecError(f"option {key}={value!r}{via(key)} must be {must}")
        for key in ("bandwidth", "watchdog_s"):
            setattr(o, key, float(getattr(o, key)))
        if o.dump_dir:
            why = _unwritable(o.dump_dir)
            if why:
                raise FusecError(f"option dump_dir={o.dump_dir!r}{via('dump_dir')} is not a folder fusec can "
                                 f"write into ({why}); give a writable folder or leave dump_dir unset")
        if o.profile_dir is not None and (d.get("profile") is not False):
            o.profile = True
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
            from fusec.cuda.knobs import KNOBS, RANGES   # the kernel's knobs (a misspelt one would do nothing)
            unknown = sorted(set(o.defines) - set(KNOBS))
            if unknown:
                raise FusecError(f"option defines{via('defines')}: unknown kernel knob(s) {unknown}; "
                                 f"known: {sorted(KNOBS)}")
            for k, v in o.defines.items():
                lo, hi = RANGES.get(k, (None, None))
                if (lo is not None and v < lo) or (hi is not None and v > hi):
                    raise FusecError(f"option defines{via('defines')}: {k}={v} is out of range; it takes "
                                     f"{lo if lo is not None else '...'} to {hi if hi is not None else '...'}")
        return o


def check_declared(cls: type) -> None:
    """Raise TypeError unless every field of the dataclass ``cls`` declares ``lowering`` (:func:`_opt`)."""
    undeclared = [f.name for f in dataclasses.fields(cls) if "lowering" not in f.metadata]
    if undeclared:
        raise TypeError(f"{cls.__name__} fields {undeclared} do not declare whether they change "
                        "lowering (define them with fusec.config._opt)")


check_declared(Options)   # at import: a new option must say whether it changes lowering


def lowering_options(opts: Options) -> dict[str, Any]:
    """The options that change the schedule or the kernel source, as the artifact key holds them:
    every field declared with a ``lowering`` function (:func:`_opt`), by name."""
    return {f.name: f.metadata["lowering"](getattr(opts, f.name))
            for f in dataclasses.fields(opts) if f.metadata["lowering"] is not None}
