"""codegen: render a schedule into the CUDA source of one persistent kernel, plus the
instruction words, queue offsets and wait lists the kernel reads.

Every root buffer gets an index into the kernel's ``bufs[]`` pointer table (a view at an offset
into a buffer, ``TensorInfo.offset``, is that pointer plus a constant); every op gets
one ``case`` of the dispatch switch: the call its kind's class declares (``call``,
:class:`fusec.instructions.call.Call`), else its template's ``call(a)`` macro, with the C types,
shapes (compile-time constants) and pointer expressions the class computes in ``cuda_args``;
the kind's template (``templates/<kind>.cu.j2``) defines the device function. The opcode of an
instruction is its op's index: nothing is numbered by hand.

Run-time lengths (a length-polymorphic graph: the KV cache's rows, a mask over them): the one
size that is not a compile-time constant. :meth:`Buffers.length` gives its C expression, a read
of a slot of the pointer table that the runtime sets at each call (``FUSEC_LEN(bufs[N])``), so
one kernel serves every cache length up to the capacity.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import jinja2
import torch

from fusec import abi, template_dir
from fusec.abi import WORD, Word
from fusec.cuda.gen.core import LEN_PREFIX   # "#len:": a length slot's name in KernelPlan.buffers
from fusec.cuda.knobs import KNOBS   # the kernel's tuning knobs and defaults (what each does: there)
from fusec.errors import FallbackRequired
from fusec.instructions import kind_of
from fusec.instructions.base import CTA_THREADS
from fusec.ir import Graph, Role
from fusec.ir.schedule import Schedule

THREADS = CTA_THREADS
MAX_SMEM_BYTES = 227 * 1024   # dynamic shared memory per CTA on sm_90 (opt-in maximum)
#: FUSEC_DISPATCH_BY_KIND keeps the per-op dispatch when its tables would pass this many bytes
DISPATCH_TABLE_LIMIT = 48 * 1024
#: FUSEC_STAGE_QUEUE stages at most this many bytes (queue, waits, buffer table; with
#: FUSEC_DISPATCH_BY_KIND the case and argument tables too) in shared memory; static shared
#: memory is capped at 48 KiB per CTA, and the kernel's other static arrays take < 1 KiB
STAGE_LIMIT = 40 * 1024

CTYPES = {torch.bfloat16: "__nv_bfloat16", torch.float32: "float", torch.float16: "__half",
          torch.int64: "i64", torch.int32: "int", torch.bool: "bool"}


class Buffers:
    """Root buffer -> index in ``bufs[]``, with C types and pointer expressions; also hands out
    spare counters (atomic tickets) after the ``counter_base`` instruction counters."""

    def __init__(self, g: Graph, counter_base: int = 0):
        self.g = g
        self.names: list[str] = []
        self._ids: dict[str, int] = {}
        self.counter_base = counter_base
        self.n_spare = 0
        self._spare: dict[str, tuple[int, int]] = {}

    def counters(self, key: str, n: int) -> str:
        """C expression of ``n`` spare ``unsigned`` counters owned by ``key`` (an op name): zero at
        load and after every reset, never signalled by an instruction. The same key gets the
        same counters."""
        if key not in self._spare:
            self._spare[key] = (self.counter_base + self.n_spare, n)
            self.n_spare += n
        base, have = self._spare[key]
        if have != n:
            raise ValueError(f"spare counters of {key}: asked for {n}, have {have}")
        return f"(counters + {base})"

    def id(self, t: str) -> int:
        r = self.g.root(t)
        if r not in self._ids:
            self._ids[r] = len(self.names)
            self.names.append(r)
        return self._ids[r]

    @staticmethod
    def cname(dtype: torch.dtype) -> str:
        if dtype not in CTYPES:
            raise FallbackRequired(f"dtype {dtype} has no CUDA type in fusec (its kernel takes bfloat16, float16 "
                                   f"and float32 tensors, int32/int64 and bool indices): cast the model, "
                                   f"e.g. model.to(torch.bfloat16)")
        return CTYPES[dtype]

    def ctype(self, t: str) -> str:
        return self.cname(self.g.tensors[t].dtype)

    def ptr(self, t: str) -> str:
        """C pointer expression of ``t``'s first element: its root's slot of ``bufs[]``, plus the
        element offset of a view (``TensorInfo.offset``, :meth:`fusec.ir.Graph.span`: a compile-time
        constant; the table holds root buffers only)."""
        root, start, _ = self.g.span(t)
        info = self.g.tensors[root]
        const = "const " if info.role in (Role.WEIGHT, Role.CONSTANT, Role.INPUT) else ""
        if start:
            if (start * info.dtype.itemsize) % self.g.tensors[t].dtype.itemsize:
                raise FallbackRequired(f"view {t} starts inside an element of its type")
            off = start * info.dtype.itemsize // self.g.tensors[t].dtype.itemsize
            return f"(({const}{self.ctype(t)}*)bufs[{self.id(t)}] + {off})"
        return f"(({const}{self.ctype(t)}*)bufs[{self.id(t)}])"

    def length(self, t: str, dim: int) -> str:
        """C expression (an ``int``) of the run-time size of dim ``dim`` of tensor ``t``: the
        literal size when the dim has no symbol; else ``FUSEC_LEN(bufs[N])``, a read of the
        pointer table's slot ``"#len:" + symbol`` (:data:`LEN_PREFIX`), which the runtime fills
        with the symbol's size at each call. One slot per symbol, listed in ``names`` (so in
        :attr:`KernelPlan.buffers`) like a buffer."""
        sym = self.symbol(t, dim)
        if sym is None:
            return str(int(self.g.tensors[t].shape[dim]))
        return f"FUSEC_LEN(bufs[{self.slot(LEN_PREFIX + sym)}])"

    def symbol(self, t: str, dim: int) -> str | None:
        """The length symbol of dim ``dim`` of ``t``, None for a static dim."""
        info = self.g.tensors[t]
        sym = info.sym
        if not sym:   # an alias of a symbolic root with the root's shape has the root's dims
            root = self.g.tensors[self.g.root(t)]
            sym = root.sym if tuple(root.shape) == tuple(info.shape) else {}
        return sym.get(dim)

    def slot(self, name: str) -> int:
        """Index in ``bufs[]`` of the pseudo-buffer ``name`` (a length slot)."""
        if name not in self._ids:
            self._ids[name] = len(self.names)
            self.names.append(name)
        return self._ids[name]


@dataclasses.dataclass
class KernelPlan:
    """What the runtime needs besides the CUBIN.

    Attributes:
        source: CUDA C++ of the kernel ``fusec_step``.
        buffers: root tensor names in ``bufs[]`` order; a name starting with :data:`LEN_PREFIX` is a
            length slot (the run-time size of that symbol, not a pointer).
        words: instruction words, ``WORD`` int32 each (fields :class:`fusec.abi.Word`), grouped
            by SM in queue order.
        queue_off: ``num_sms + 1`` offsets (in instructions) of each SM's queue in ``words``.
        waits: concatenated wait lists, two int32 per wait: the counter (the producer op's
            index) and that op's number of tiles (the wait is for tiles x epoch).
        n_counters: counters to allocate: one per op (its index), then the spare ones
            (atomic tickets, :meth:`Buffers.counters`).
        smem_bytes: dynamic shared memory per CTA.
        profile: the kernel takes one more argument, a [instructions, len(Prof) + PROF_MARKS]
            uint64 buffer where each instruction records (SM, fetched, waits satisfied, done:
            :class:`fusec.abi.Prof`) and then the ``FUSEC_MARK(k)`` timestamps its template took
            (0: not taken), %globaltimer ns.
    """

    source: str
    buffers: list[str]
    words: list[int]
    queue_off: list[int]
    waits: list[int]
    n_counters: int
    smem_bytes: int
    threads: int
    num_sms: int
    profile: bool = False


def _env() -> jinja2.Environment:
    """The templates' Jinja environment; every template sees the host-kernel layouts as ``abi``
    (:mod:`fusec.abi`, rendered by ``abi.cuh.j2``)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True)
    env.globals["abi"] = abi
    return env


def render(s: Schedule, title: str = "", threads: int = THREADS, profile: bool = False,
           defines: dict[str, Any] | None = None) -> KernelPlan:
    """Render ``s`` to a :class:`KernelPlan`.

    ``profile`` adds per-instruction timestamps (see :class:`KernelPlan`); ``defines`` override
    the tuning knobs' defaults (:data:`KNOBS`) and add ``#define`` lines before the templates.

    Raises:
        FallbackRequired: an op (or a dtype) has no CUDA form, or needs more shared memory than
            a CTA can have; the message names it.
        ValueError: ``threads`` differs from ``CTA_THREADS``.
    """
    if threads != CTA_THREADS:
        raise ValueError(f"threads={threads}: the templates size shared memory for {CTA_THREADS} threads")
    g = s.graph
    env = _env()
    bufs = Buffers(g, counter_base=len(g.ops))
    op_index = {op.name: k for k, op in enumerate(g.ops)}
    cases, smem = [], 0
    macros: dict[str, Any] = {}       # kind -> its template module, in first-use order
    gen_sources: dict[str, str] = {}  # generated generic-op functions (fusec.cuda.gen), by name
    gen_helpers: list[str] = []       # the header files they need, once each
    for k, op in enumerate(g.ops):
        cls = kind_of(op)
        try:
            args = cls.cuda_args(op, g, bufs)
        except NotImplementedError as e:
            raise FallbackRequired(f"no CUDA form: {e}") from None
        # the kinds whose definitions the call needs (a chain's members' kinds, or a shared template
        # such as a batch's matvec_seqs), then its own
        for name in [*args.get("uses", ()), cls.name]:
            if name not in macros:
                macros[name] = env.get_template(f"{name}.cu.j2").module
        mod = macros[cls.name]
        for gen in args.get("sources", [args] if "source" in args else []):
            gen_sources.setdefault(gen["name"], gen["source"])
            if gen.get("helpers") and gen["helpers"] not in gen_helpers:
                gen_helpers.append(gen["helpers"])
        early = mod.early(args).strip() if hasattr(mod, "early") else ""
        call = cls.call.text(op, args) if cls.call is not None else mod.call(args).strip()
        call = args.get("pre", "") + call   # a folded prologue's statements (fusec/instructions/prologue.py)
        cases.append({"op": k, "name": op.name, "kind": op.kind, "layer": op.layer,
                      "call": call, "early": early})
        smem = max(smem, cls.smem_floats(op, g))
    defines = {**KNOBS, **(defines or {})}
    if smem * 4 > MAX_SMEM_BYTES:
        big = max(g.ops, key=lambda op: kind_of(op).smem_floats(op, g))
        raise FallbackRequired(f"op {big.name} ({big.kind}) needs {smem * 4} B of shared memory per CTA, "
                               f"more than the {MAX_SMEM_BYTES} B an sm_90 CTA can have")
    words, waits, queue_off = [], [], [0]
    ops = g.op_by_name()
    counter_waits = s.counter_waits()
    for q in s.queues:
        for iid in q:
            ins = s.instrs[iid]
            op = ops[ins.op]
            p = kind_of(op).encode(op, ins.tile)
            cw = counter_waits[iid]
            word = [0] * WORD
            word[Word.OP], word[Word.WAIT_OFF], word[Word.WAIT_CNT], word[Word.ID] = \
                op_index[ins.op], len(waits) // 2, len(cw), ins.id
            word[Word.P0:Word.P3 + 1] = (p + [0] * 4)[:4]
            words += word
            waits += [x for pair in cw for x in pair]
        queue_off.append(len(words) // WORD)
    # int(): FUSEC_DEFINES gives strings ("0" must turn the shared dispatch off, as the #define does)
    by_kind = int(defines["FUSEC_DISPATCH_BY_KIND"]) != 0
    kind_cases, opargs, maxa = dispatch_by_kind(cases) if by_kind else (None, [], 0)
    if kind_cases is not None and 4 * len(g.ops) * (maxa + 1) > DISPATCH_TABLE_LIMIT:
        kind_cases = None
    qmax = max(b - a for a, b in zip(queue_off, queue_off[1:]))
    wmax = max((sum(words[i * WORD + Word.WAIT_CNT] for i in range(a, b))
                for a, b in zip(queue_off, queue_off[1:])), default=0)
    n_bufs = len(bufs.names)
    stage_bytes = 8 * n_bufs + 4 * WORD * qmax + 8 * wmax + (4 * len(g.ops) * (maxa + 1) if kind_cases else 0)
    source = env.get_template("kernel.cu.j2").render(
        n_bufs=max(1, n_bufs), qmax=max(1, qmax), wmax=max(1, wmax), stage_limit=STAGE_LIMIT,
        stage_fits=stage_bytes <= STAGE_LIMIT and smem * 4 + stage_bytes + 1024 <= MAX_SMEM_BYTES,
        title=title or "decode step", num_sms=s.num_sms, threads=threads, smem_bytes=smem * 4,
        n_instrs=len(s.instrs), n_ops=len(g.ops), n_waits=len(waits) // 2, kinds=list(macros), macros=macros,
        cases=cases, kind_cases=kind_cases, opargs=opargs, maxa=maxa,
        case_of=[next(kc["id"] for kc in kind_cases if c["op"] in kc["ops"]) for c in cases] if kind_cases else [],
        profile=profile, defines=defines,
        gen_sources=list(gen_sources.values()), gen_helpers=gen_helpers)
    return KernelPlan(source, bufs.names, words, queue_off, waits or [0, 1], len(g.ops) + bufs.n_spare,
                      max(16, smem * 4), threads, s.num_sms, profile)


_BUF = re.compile(r"bufs\[(\d+)\]")
_CTR = re.compile(r"\(counters \+ (\d+)\)")


def dispatch_by_kind(cases: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[list[int]], int]:
    """Share one dispatch case among the ops whose calls differ only in buffer indices and
    spare-counter offsets (the layers of a kind).

    Each ``bufs[N]`` and ``(counters + N)`` of an op's call becomes ``bufs[A[j]]`` /
    ``(counters + A[j])``, j counting from the left (a buffer or counter that the call names
    again, as a folded prologue's two forms do, takes its first j); ops with the same rewritten
    call share a case, and ``A`` is the op's row of the argument table (its N, in order). Expects
    ``cases`` in op order (``cases[k]["op"] == k``). Returns (the shared cases, each with ``id``,
    ``call``, ``kind`` and its ``ops``; the table rows by op, padded to the widest; its width).
    """
    kinds: dict[str, dict[str, Any]] = {}
    rows: list[list[int]] = []
    for c in cases:
        row: list[int] = []
        seen: dict[tuple[str, int], int] = {}   # a buffer or counter named again takes its first slot

        def slot(m: re.Match, fmt: str) -> str:
            key = (fmt, int(m.group(1)))
            if key not in seen:
                seen[key] = len(row)
                row.append(key[1])
            return fmt.format(seen[key])

        call = _BUF.sub(lambda m: slot(m, "bufs[A[{}]]"), c["call"])
        call = _CTR.sub(lambda m: slot(m, "(counters + A[{}])"), call)
        kc = kinds.setdefault(call, {"id": len(kinds), "call": call, "kind": c["kind"], "ops": []})
        kc["ops"].append(c["op"])
        rows.append(row)
    width = max((len(r) for r in rows), default=0)
    return list(kinds.values()), [r + [0] * (width - len(r)) for r in rows], width


def describe(plan: KernelPlan) -> dict[str, Any]:
    return {"buffers": len(plan.buffers), "instructions": len(plan.words) // WORD,
            "waits": len(plan.waits) // 2, "smem_bytes": plan.smem_bytes, "threads": plan.threads}
