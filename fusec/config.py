"""Every fusec option and environment variable, typed, in one place.

Options reach the backend as ``torch.compile(..., options={...})``; environment variables
give defaults: ``FUSEC_DUMP`` (folder: dump every stage's artifact), ``FUSEC_CACHE_DIR``
(NVRTC CUBIN cache), ``FUSEC_NUM_SMS``, ``FUSEC_FALLBACK``, ``FUSEC_MAX_FUSIONS``.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from .errors import FusecError

TARGETS = ("sim", "cuda")
FALLBACKS = ("inductor", "eager")


@dataclasses.dataclass
class Options:
    """Compilation options.

    Attributes:
        target: "sim" (CPU simulator) or "cuda"; None follows the model's tensors.
        num_sms: SMs (CTAs) to schedule for; None: 132 (an H200; the GPU back end will use the device count).
        dump_dir: folder for stage artifacts (captured graph, IR per pass, schedule.json).
        fallback: backend for graphs fusec cannot place: "inductor" (where it works) or "eager".
        seed: seed of the simulator's interleaving.
        check_hazards: run the simulator's hazard check every step.
        max_fusions: apply at most this many fusions (bisecting); None = all.
        bandwidth: bytes/s used to predict step time from bytes (4.3e12: H200 measured read).
        watchdog_s: GPU counter waits give up after this many seconds (WatchdogError).
        check_watchdog: read the watchdog record after every GPU step (a host sync); turn off
            for CUDA-graph capture and benchmarks.
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

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "Options":
        """Options from a dict over the environment defaults; unknown keys are an error."""
        env = {}
        if os.environ.get("FUSEC_DUMP"):
            env["dump_dir"] = os.environ["FUSEC_DUMP"]
        if os.environ.get("FUSEC_NUM_SMS"):
            env["num_sms"] = int(os.environ["FUSEC_NUM_SMS"])
        if os.environ.get("FUSEC_FALLBACK"):
            env["fallback"] = os.environ["FUSEC_FALLBACK"]
        if os.environ.get("FUSEC_MAX_FUSIONS"):
            env["max_fusions"] = int(os.environ["FUSEC_MAX_FUSIONS"])
        d = {**env, **(d or {})}
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - names)
        if bad:
            raise FusecError(f"unknown fusec option(s) {bad}; known: {sorted(names)}")
        for key in ("num_sms", "max_fusions", "seed"):
            if d.get(key) is not None and (not isinstance(d[key], int) or isinstance(d[key], bool)):
                raise FusecError(f"option {key}={d[key]!r} must be an int")
        o = cls(**d)
        if o.target is not None and o.target not in TARGETS:
            raise FusecError(f"option target={o.target!r} must be one of {TARGETS}")
        if o.fallback not in FALLBACKS:
            raise FusecError(f"option fallback={o.fallback!r} must be one of {FALLBACKS}")
        if o.num_sms is not None and o.num_sms < 1:
            raise FusecError(f"option num_sms={o.num_sms} must be >= 1")
        return o
