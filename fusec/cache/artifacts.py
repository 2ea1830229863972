"""The artifact cache: a lowered schedule and its rendered kernel, reused by later processes.

:func:`compile_graph` wraps the stage list of :mod:`fusec.pipeline` once (stage ``artifacts``).
A process that compiles a decode step fusec compiled before (same captured graph, options and
fusec, torch and NVRTC versions) loads the :class:`~fusec.ir.schedule.Schedule` and the
:class:`~fusec.cuda.codegen.KernelPlan` from disk instead of running the passes and rendering
the kernel; NVRTC then finds the CUBIN in its own cache (:mod:`fusec.cuda.jit`, keyed on the
source). Weights are not part of an artifact: they are graph inputs, bound when the step runs
(the simulator reads them from the call's arguments, the GPU runtime writes their pointers into
its buffer table), so a model with other weight values reuses the artifact.

**Key**: the sha256 of
- the captured IR (:func:`graph_text`): the step's batch and query tokens (``Graph.batch_size``,
  ``query_len``); every tensor's name, shape, dtype, role, input index and
  alias (with a view's offset), plus a digest of the value of each CONSTANT (``get_attr`` tensors of the ATen graph);
  every op's name, kind, slots, in-place slots, layer, model source line and attributes (the
  ATen call templates with their literals included). FX names are deterministic for one model
  and one torch / transformers version, so the text is the same in every process;
- the options that change lowering or rendering (:func:`fusec.config.lowering_options`: each
  option declares it where :class:`~fusec.config.Options` defines it; today ``num_sms`` as
  lowered, 132 when unset, ``max_fusions``, ``attention_merge``, ``profile``, ``defines``);
- the fusec version and a digest of fusec's source files (the package, the passes, the
  templates: :func:`source_digest`), so that any code change gives new keys;
- torch's version, NVRTC's version (None where NVRTC cannot load), Python's ``major.minor``
  and :data:`FORMAT`.

Weight values are never part of the key.

**Validation**: a few passes read the values of small weights (at most
``position.MAX_KNOWN_WEIGHT`` elements) and compile them in: ``inv_freq`` becomes the RoPE
tables, Gemma's ``1 + w`` a constant. An artifact records a digest of exactly the weights the
passes read (:class:`fusec.pipeline.ValueReads`; none of the large matrices, none of the norm
weights the kernel reads at run time). A hit whose recorded digests differ from the current
model's tensors is rejected with one log line; the step is lowered again and the entry
replaced.

**Layout**: ``<FUSEC_CACHE_DIR>/artifacts/<key>.art`` (``FUSEC_CACHE_DIR`` defaults to
``~/.cache/fusec``), one file per key: :data:`MAGIC`, the sha256 of the rest, then the entry's
tensors as a safetensors blob (its length first) and the JSON of ``{"format", "key", "schedule",
"plan", "values", "fusec", "created"}`` (:mod:`fusec.cache.entry_codec`'s plain form) whose
tensors and bytes are references into the blob and whose ATen ops are names. An entry is written
to a temp file in the same folder, then ``os.replace``d: concurrent processes only ever see whole
entries (the last writer wins). A file
that fails the checksum or does not load is ignored with one log line, and the new
compilation rewrites it. After each store the folder is cut down to ``cache_max_mb`` (option;
env ``FUSEC_CACHE_MAX_MB``; default 4096 MiB) by removing the least recently used entries (a hit
touches its file's mtime). Off with option ``cache=False`` or ``FUSEC_CACHE=0``. With
``dump_dir`` (``FUSEC_DUMP``) set the cache is not read, only written: every stage then runs and
is dumped.

**Trust**: loading one of fusec's entries runs no code the entry chooses: parsing JSON builds
containers and values only, and :mod:`fusec.cache.entry_codec` builds from that plain data only
fusec's IR classes (``object.__new__`` and their fields, no ``__init__``), enums, torch values
and tensors read from safetensors, and looks ATen operators up by name without calling them. The checksum detects damage, not tampering: an edited entry can still describe a
wrong step (as an edited source file would), and its kernel source is what NVRTC compiles and
the GPU runs. The precompiled dynamo entries
(:mod:`fusec.frontend.precompiled`, kind ``precompiled``) hold torch's own serialized format,
which torch loads with pickle: whoever can write to the cache folder can run code through those,
as with torch's own compile caches. Keep ``FUSEC_CACHE_DIR`` private to the users who share it.
Entries are written readable by all (mode 0644).
"""
from __future__ import annotations

import enum
import functools
import hashlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fusec import pipeline
from fusec.cache import entry_codec
from fusec.config import Options, lowering_options
from fusec.ir import Graph, Ref
from fusec.ir.schedule import Schedule
from fusec.pipeline import Dumper, Lowered, gc_paused

log = logging.getLogger("fusec")

#: version of the entry format (bump when the encoded objects change shape incompatibly)
FORMAT = 4
MAGIC = b"FUSECAR4"   # 4: tensors (and bytes) as safetensors, the rest as JSON (entry_codec)
SUFFIX = ".art"
#: a temp file older than this is what a killed writer left: removed by the next store
_STALE_TMP_S = 3600.0


class Uncacheable(Exception):
    """The graph holds something with no stable text (an object printed with its address)."""


# ----------------------------------------------------------------------------- the key

def _cpu_bytes(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``t`` on the CPU, contiguous, and its bytes as a uint8 numpy array (None when empty)."""
    with unset_fake_temporarily():   # a graph's constant, while AOT autograd's fake mode is on
        t = t.detach().to("cpu").contiguous()
        return t, (t.reshape(-1).view(torch.uint8).numpy() if t.numel() else None)


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (copied to the CPU first)."""
    t, raw = _cpu_bytes(t)
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    if raw is not None:
        h.update(raw)
    return h.hexdigest()


def _canon(v: Any) -> str:
    """A text for an op attribute that is equal across processes exactly when the value is."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)
    if isinstance(v, enum.Enum):
        return f"{type(v).__name__}.{v.name}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_canon(k)}: {_canon(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return ("(" if isinstance(v, tuple) else "[") + ", ".join(_canon(x) for x in v) + ")"
    if isinstance(v, Ref):
        return f"Ref({v.slot!r})"
    if isinstance(v, torch.Tensor):
        return f"tensor:{tensor_digest(v)}"
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(v)
    if isinstance(v, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"op:{v}"
    if callable(v) and getattr(v, "__qualname__", None) and getattr(v, "__module__", None):
        return f"fn:{v.__module__}.{v.__qualname__}"
    text = repr(v)
    if " at 0x" in text:
        raise Uncacheable(f"an attribute of type {type(v).__name__} has no stable text ({text[:80]})")
    return f"{type(v).__qualname__}:{text}"


def graph_text(g: Graph) -> str:
    """The whole structure of ``g`` as text (the key's graph part; see the module docstring)."""
    lines = [f"inputs {g.inputs}", f"outputs {g.outputs}", f"skip {g.skip_args}",
             f"lengths {sorted(g.lengths.items())}", f"rows {g.batch_size} {g.query_len}"]
    for t in g.tensors.values():
        value = tensor_digest(t.value) if t.value is not None else "-"
        alias = t.alias_of if t.offset is None else f"{t.alias_of}+{t.offset}"   # a view: its offset
        lines.append(f"T {t.name} {list(t.shape)} {t.dtype} {t.role.value} {t.input_index} "
                     f"{alias} {value} {sorted(t.sym.items())}")
    for op in g.ops:
        lines.append(f"O {op.name} {op.kind} {_canon(op.inputs)} {_canon(op.outputs)} "
                     f"{list(op.mutates)} {op.layer} {op.source!r} {_canon(op.attrs)}")
    return "\n".join(lines) + "\n"


@functools.cache
def source_digest() -> str:
    """sha256 over fusec's source: the package's ``.py`` files, the passes and the templates."""
    import importlib

    import fusec
    passes = importlib.import_module("fusec.passes")
    roots = [("fusec", Path(fusec.__file__).resolve().parent, "*.py"),
             ("passes", Path(passes.__file__).resolve().parent, "*.py"),
             ("templates", fusec.template_dir().resolve(), "*")]
    h = hashlib.sha256()
    for label, root, pattern in roots:
        files = sorted(p for p in root.rglob(pattern) if p.is_file() and "__pycache__" not in p.parts)
        for p in files:
            h.update(f"{label}/{p.relative_to(root).as_posix()}\0".encode())
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


@functools.cache
def _nvrtc_version() -> str | None:
    try:
        from fusec.cuda.jit import nvrtc_version
        return ".".join(map(str, nvrtc_version()))
    except Exception:   # noqa: BLE001 - no NVRTC here: the key says so
        return None


def toolchain() -> dict[str, Any]:
    """The part of every key that is not the graph: the entry format, fusec's version and source
    digest, torch's and NVRTC's versions, Python's ``major.minor``."""
    import fusec
    return {"format": FORMAT, "fusec": fusec.__version__, "source": source_digest(), "torch": torch.__version__,
            "nvrtc": _nvrtc_version(), "python": f"{sys.version_info[0]}.{sys.version_info[1]}"}


def artifact_key(g: Graph, opts: Options) -> str:
    """The cache key of lowering ``g`` with ``opts`` (hex sha256; raises :class:`Uncacheable`)."""
    parts = {**toolchain(), "graph": hashlib.sha256(graph_text(g).encode()).hexdigest(),
             "options": lowering_options(opts)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------- entries

def _no_constant(name: str) -> Any:
    raise ValueError(f"entry holds the non-standard JSON constant {name}")


def _finite(text: str) -> float:
    """A JSON number as a float; one that overflows (``1e999``) is refused: fusec writes
    non-finite floats as tagged strings."""
    x = float(text)
    if x in (math.inf, -math.inf):
        raise ValueError(f"entry holds the out-of-range number {text[:32]}")
    return x


def dumps(obj: Any) -> bytes:
    """An entry's bytes: :data:`MAGIC`, the sha256 of the rest, the safetensors blob's length
    (8 bytes, little-endian), the blob (the entry's tensors and bytes), then the entry as JSON
    (:func:`fusec.cache.entry_codec.encode`'s plain data, UTF-8, standard JSON: no NaN)."""
    from safetensors.torch import save
    with gc_paused():   # ~10^5 small containers: the cyclic GC would walk them again and again
        data, tensors = entry_codec.encode(obj)
        blob = save(tensors)
        text = json.dumps(data, separators=(",", ":"), allow_nan=False).encode()
        body = len(blob).to_bytes(8, "little") + blob + text
    return MAGIC + hashlib.sha256(body).digest() + body


def loads(data: bytes) -> Any:
    """Inverse of :func:`dumps`, running no code named by the entry: the JSON parser builds
    containers and values only, and :func:`fusec.cache.entry_codec.decode` builds only fusec's
    IR classes (without calling their ``__init__``), enums, tensors and torch values, and looks
    operators up by name without calling them.

    Raises:
        ValueError: a damaged entry (magic, checksum, lengths, not JSON, an unknown tag or class)."""
    from safetensors.torch import load
    n = len(MAGIC)
    if data[:n] != MAGIC:
        raise ValueError("not an artifact file of this format (bad magic)")
    digest, body = data[n:n + 32], data[n + 32:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("checksum mismatch (truncated or damaged)")
    size = int.from_bytes(body[:8], "little")
    if size > len(body) - 8:
        raise ValueError("safetensors blob longer than the entry")
    tensors = load(body[8:8 + size])
    with gc_paused():   # the 1B's entry is ~10^5 small objects: the cyclic GC would walk them all
        plain = json.loads(body[8 + size:], parse_constant=_no_constant, parse_float=_finite)
        return entry_codec.decode(plain, tensors)


#: an entry kind's payload field and type, where it is not an IR graph under ``graph``
#: (:data:`fusec.frontend.warm.KIND`): a precompiled step's bytes (:mod:`fusec.frontend.precompiled`)
KIND_PAYLOAD: dict[str, tuple[str, type]] = {"precompiled": ("data", bytes)}


def cache_folder() -> Path:
    """``artifacts/`` in NVRTC's cache folder (:func:`fusec.cuda.jit.cache_folder`:
    ``$FUSEC_CACHE_DIR``, default ``~/.cache/fusec``)."""
    from fusec.cuda import jit
    return jit.cache_folder() / "artifacts"


class ArtifactCache:
    """The folder of entries, capped at ``max_bytes`` (least recently used out)."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder = Path(folder)
        self.max_bytes = max_bytes

    @classmethod
    def for_options(cls, opts: Options) -> "ArtifactCache | None":
        """The cache ``opts`` asks for, or None when it is off."""
        if not opts.cache:
            return None
        return cls(cache_folder(), opts.cache_max_mb << 20)

    def path(self, key: str, kind: str | None = None) -> Path:
        """``<key>.art`` for a lowered step, ``<key>.<kind>.art`` for another kind of entry."""
        return self.folder / f"{key}{'.' + kind if kind else ''}{SUFFIX}"

    def load(self, key: str, kind: str | None = None) -> dict[str, Any] | None:
        """The entry of ``key`` (its mtime touched), or None: absent, or unreadable (one log line).

        ``kind``: None for a lowered step (a schedule and weight digests), else the ``kind`` the
        entry must carry (:data:`fusec.frontend.warm.KIND`: an IR graph; :data:`KIND_PAYLOAD`: others)."""
        path = self.path(key, kind)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("fusec: artifact cache: cannot read %s (%s); compiling", path, e)
            return None
        try:
            art = loads(data)
            if not isinstance(art, dict) or art.get("format") != FORMAT or art.get("key") != key:
                raise ValueError("not an entry of this key and format")
            if kind is not None:
                field, cls = KIND_PAYLOAD.get(kind, ("graph", Graph))
                if art.get("kind") != kind or not isinstance(art.get(field), cls):
                    raise ValueError(f"not a {kind} entry")
            elif not isinstance(art.get("schedule"), Schedule) or not isinstance(art.get("values"), dict) \
                    or "plan" not in art or not all(hasattr(art["schedule"], f) for f in ("graph", "instrs")):
                raise ValueError("no schedule, plan or weight digests in the entry")
        except Exception as e:   # noqa: BLE001 - any damage: ignore the entry, compile, rewrite it
            log.warning("fusec: artifact cache: ignoring unreadable entry %s (%s: %s); compiling and "
                        "rewriting it", path, type(e).__name__, str(e)[:200])
            return None
        try:
            os.utime(path)   # least recently used goes first: a hit is a use
        except OSError:
            pass
        return art

    def store(self, key: str, art: dict[str, Any]) -> int | None:
        """Write the entry of ``key`` (of ``art["kind"]``, if any) atomically, then evict down to
        the cap; returns its size in bytes, or None when it was not written (one log line says
        why)."""
        try:
            data = dumps(art)
        except Exception as e:   # noqa: BLE001 - a compile never fails for the cache's sake
            log.warning("fusec: artifact cache: entry %s not stored: %s: %s", key[:12], type(e).__name__,
                        str(e)[:200])
            return None
        if len(data) > self.max_bytes:
            log.info("fusec: artifact cache: entry %s not stored: %.1f MiB, over the cap of %.0f MiB "
                     "(cache_max_mb, FUSEC_CACHE_MAX_MB)", key[:12], len(data) / 2**20, self.max_bytes / 2**20)
            return None
        path = self.path(key, art.get("kind"))
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            from fusec.cuda.jit import atomic_write
            atomic_write(path, data)
        except OSError as e:
            log.warning("fusec: artifact cache: entry %s not stored in %s: %s", key[:12], self.folder, e)
            return None
        self.evict(keep=path)
        return len(data)

    def entries(self) -> list[tuple[float, int, Path]]:
        """``(mtime, bytes, path)`` of every entry, least recently used first; removes temp
        files that killed writers left behind."""
        out = []
        now = time.time()
        try:
            names = list(self.folder.iterdir())
        except OSError:
            return []
        for p in names:
            try:
                st = p.stat()
            except OSError:
                continue
            if p.name.endswith(".tmp"):
                if now - st.st_mtime > _STALE_TMP_S:
                    p.unlink(missing_ok=True)
                continue
            if p.suffix == SUFFIX:
                out.append((st.st_mtime, st.st_size, p))
        return sorted(out, key=lambda e: (e[0], e[2].name))

    def evict(self, keep: Path | None = None) -> int:
        """Remove least recently used entries (never ``keep``) until the folder fits the cap;
        returns how many were removed. Another process removing the same file is fine."""
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        removed = 0
        for _, size, p in entries:
            if total <= self.max_bytes:
                break
            if keep is not None and p == keep:
                continue
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                continue
            total -= size
            removed += 1
        if removed:
            log.info("fusec: artifact cache: removed %d least recently used entr%s (cap %.0f MiB)",
                     removed, "y" if removed == 1 else "ies", self.max_bytes / 2**20)
        return removed


# ----------------------------------------------------------------------------- the stage

def _stale(values: dict[str, str], g: Graph, flat_args: list[Any]) -> list[str]:
    """The recorded small weights whose current values differ from the artifact's."""
    index = {n: i for i, n in enumerate(g.inputs)}
    bad = []
    for name, digest in values.items():
        i = index.get(name)
        if i is None or not isinstance(flat_args[i], torch.Tensor) or tensor_digest(flat_args[i]) != digest:
            bad.append(name)
    return bad


def compile_graph(g: Graph, flat_args: list[Any], opts: Options, dump: Dumper, *,
                  target: str = "sim") -> Lowered:
    """The stages of :func:`fusec.pipeline.stages` on ``g`` for ``target``, wrapped once by the
    cache (stage ``artifacts``): a valid entry gives the schedule and the plan without running
    the passes and the rendering; else the stages run and their products are stored. For the
    ``cuda`` target the plan is rendered where the entry has none (the simulator's), and NVRTC
    (stage ``nvrtc``) is started on a thread before the entry is stored: ``Lowered.kernel``
    waits for it.

    Raises:
        What the stages raise (FallbackRequired, IRError ...); never a cache error.
    """
    cache = ArtifactCache.for_options(opts)
    key = None
    if cache is not None:
        t0 = time.perf_counter()
        try:
            key = artifact_key(g, opts)
        except Uncacheable as e:
            log.info("stage %-13s not used: %s", "artifacts", e)
        if key is not None and opts.dump_dir:
            log.info("stage %-13s not read (dump_dir is set: every stage runs and is dumped)", "artifacts")
        elif key is not None:
            art = cache.load(key)
            bad = _stale(art["values"], g, flat_args) if art is not None else []
            if art is not None and bad:
                more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
                log.info("fusec: artifact cache: entry %s was compiled for other values of %s%s (small "
                         "weights whose values are compiled in); lowering again", key[:12], bad[0], more)
            elif art is not None:
                sched, plan = art["schedule"], art["plan"]
                sched.compiled_in = dict(art["values"])
                log.info("stage %-13s hit %s: %d instructions, %s, %d compiled-in weight%s equal  (%.2f s)",
                         "artifacts", key[:12], len(sched.instrs),
                         "kernel source" if plan is not None else "no kernel source",
                         len(art["values"]), "" if len(art["values"]) == 1 else "s", time.perf_counter() - t0)
                if target != "cuda":
                    return Lowered(sched)
                if plan is not None:   # the stages from nvrtc on
                    return Lowered(sched, plan, pipeline.run(plan, opts, dump, target=target, first="nvrtc")["nvrtc"])
                made = pipeline.run(sched, opts, dump, target=target, first="render")
                _store(cache, key, sched, made["render"], art["values"])
                return Lowered(sched, made["render"], made["nvrtc"])
            else:
                log.info("stage %-13s miss %s  (%.2f s)", "artifacts", key[:12], time.perf_counter() - t0)
    reads: set[str] = set()
    made = pipeline.run(g, opts, dump, target=target, args=flat_args, value_reads=reads)
    sched, plan = made["schedule"], made.get("render")
    index = {n: i for i, n in enumerate(g.inputs)}
    sched.compiled_in = {n: tensor_digest(flat_args[index[n]]) for n in sorted(reads)}
    if cache is not None and key is not None:
        _store(cache, key, sched, plan, sched.compiled_in)   # NVRTC meanwhile compiles on its thread
    return Lowered(sched, plan, made.get("nvrtc"))


def _store(cache: ArtifactCache, key: str, sched: Schedule, plan: Any, values: dict[str, str]) -> None:
    import fusec
    t0 = time.perf_counter()
    size = cache.store(key, {"format": FORMAT, "key": key, "schedule": sched, "plan": plan, "values": values,
                             "fusec": fusec.__version__, "created": time.time()})
    if size is not None:
        log.info("stage %-13s stored %s: %s in %s  (%.2f s)", "artifacts", key[:12], _size(size),
                 cache.folder, time.perf_counter() - t0)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"
