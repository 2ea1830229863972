"""prologue: the small vector ops in front of a row-tiled matvec kind, recomputed by each tile.

Between the fused kinds of a decoder layer, families other than Llama run a few ops over
one hidden-sized vector: a post-norm and its residual add (OLMo-2, Gemma-2/3:
``h = r + RMSNorm(o)``), a scaled residual (Granite: ``h = r + o * 0.22``), an embedding
scale (Gemma: ``x * sqrt(H)``). As a ``chain`` (:mod:`fusec.instructions.chain`) they are a
dependency level of their own on one SM, and the matvec that reads their result waits for it:
a level's fixed cost (a counter release, a poll, a prologue: 2-3 µs on the H200,
docs/performance.md) plus the chain's dependent round trips through L2 (2.9-3.4 µs measured for
a norm and an add). Folded into the matvec that reads their result, every tile of the matvec
computes them itself from their inputs (a few KB, in L2) before its rows, with the
intermediates in its shared memory: the level is gone, and what the ops cost moves into each
tile's prologue, as Llama's RMSNorm always was (``rms_prologue``).

The table of what may fold (one rule, not one kind per family):

* **members**: generic elementwise or reduction ops (ATen ops and the semantic ``rmsnorm``) and
  ``layernorm`` ops (:data:`MEMBER_KINDS`), each with a CUDA form from :mod:`fusec.cuda.gen`, no
  in-place update, static sizes, no tensor of more than :data:`MAX_ELEMS` elements per activation
  row of the step (:meth:`fusec.ir.Graph.rows`: a batch's B rows, folded only into a batched
  consumer, :mod:`fusec.passes.prologue`); every fresh output a buffer of its own (no view);
* **consumers**: kinds whose class sets ``takes_prologue`` (``matvec``, ``matvec_group``,
  ``rms_qkv_rope``, ``rms_gate_up_silu``, ``rms_lm_head``, and the column-tiled ``matvec_cols``:
  GPT-2's LayerNorms): kinds that stage their whole input vector ``x`` in shared memory first;
  their template takes ``STAGED`` (x already there);
* **a consumer's own RMSNorm** (``norm_w`` and ``eps``: ``rms_gate_up_silu`` with its norm,
  ``rms_lm_head``) becomes the prologue's last member, an ``rmsnorm`` op into a new tensor of the
  norm's output dtype; the kind then runs as without a norm over that staged vector.

The fused op (the ``prologue`` pass, :mod:`fusec.passes.prologue`, rewrites it): attribute
``pre`` the member ops in program order; ``pre_keep`` the members' outputs read after the op
(the residual stream ``h``: written to global memory by the tile whose first row is 0, the
others keep them in shared memory only); output ``x`` the staged vector (a member's output);
inputs ``pre_in*`` what the members read from outside; outputs ``pre_out*`` every other member
output. Numerics are the members' exactly: each output rounded to its dtype.

Two CUDA forms (:func:`cuda`; the knob ``FUSEC_PROLOGUE_REGS`` picks one in the kernel): in
registers (:mod:`fusec.instructions.prologue_regs`: each thread on its own elements of the
hidden vector, the members inline in one function, one barrier after it), where the members are
elementwise ops and norms over that vector; else in shared memory (each member its own generated
function over shared memory, a barrier after each). Both compute the same ops with the same
roundings in the same order (bf16 logits equal bit for bit at full depth on the H100).

Source: the ops' own semantics (:mod:`fusec.ir.semantics`, :mod:`fusec.cuda.gen`); the fold
follows the "prologue fusion" of GEMM epilogue/prologue visitors (CUTLASS's EVT, inductor's
prologue fusion), here for a vector recomputed per tile instead of loaded once.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.instructions.base import Region, Tile
from fusec.instructions.call import Flag

#: a member's tensors hold at most this many elements each (the hidden-sized vectors)
MAX_ELEMS = 16384
#: shared memory the members' intermediates take per CTA at most (bytes)
MAX_SCRATCH_BYTES = 64 * 1024
#: the same for a batched consumer (a ``matvec``, ``rms_qkv_rope`` or ``rms_gate_up_silu`` of B
#: sequences, docs/batch.md), whose members run
#: over B rows: next to its staged x (at most ``matvec_rows.STAGE_BYTES``, 128 KiB) it stays under
#: the 227 KiB of an sm_90 CTA
MAX_SCRATCH_BYTES_BATCH = 96 * 1024
#: the generic kinds a member may be (:func:`fusec.instructions.generic.generic_kind`)
MEMBER_CLASSES = ("elementwise", "reduce")
#: instruction kinds that may be members too: one-tile kinds whose op has a generated CUDA form
#: (:mod:`fusec.cuda.gen`) as well as its own template
MEMBER_KINDS = ("layernorm",)


def has(op: Op) -> bool:
    """Whether ``op`` runs a folded prologue."""
    return "pre" in op.attrs


#: the consumer templates' last template argument: x is already staged in shared memory
STAGED = Flag("staged", fn=has, default="false")


def xin(op: Op) -> str:
    """The tensor a consumer kind stages as its vector ``x``: its input, or with a prologue the
    member output it computes itself."""
    return op.outputs["x"] if has(op) else op.inputs["x"]


def can_member(m: Op, g: Graph) -> bool:
    """Whether ``m`` may be a prologue member (module docstring, "members")."""
    from fusec.instructions.base import KINDS
    from fusec.instructions.generic import generic_kind
    from fusec.cuda.gen import supported
    if (m.kind in KINDS and m.kind not in MEMBER_KINDS) or m.mutates or m.kind == "table_lookup" \
            or not supported(m.kind):
        return False
    if m.kind not in MEMBER_KINDS and generic_kind(m) not in MEMBER_CLASSES:
        return False
    for t in list(m.reads()) + list(m.writes()):
        info = g.tensors[t]
        if info.sym or g.tensors[g.root(t)].sym or info.numel > MAX_ELEMS * g.rows():
            return False
    return all(g.tensors[t].alias_of is None for t in m.fresh_outputs())


def externals(op: Op) -> list[str]:
    """The tensors a folded prologue reads from outside (its ``pre_in*`` inputs, in order)."""
    return [t for s, t in op.inputs.items() if s.startswith("pre_in")]


def vec_inputs(op: Op, norm: bool) -> list[str]:
    """What every tile of a consumer reads whole: x (and ``norm_w`` if ``norm``), or with a
    prologue the members' external inputs."""
    if has(op):
        return externals(op)
    return [op.inputs["x"], op.inputs["norm_w"]] if norm else [op.inputs["x"]]


def adjust_tiles(op: Op, g: Graph, tiles: list[Tile]) -> list[Tile]:
    """With a prologue, the tile whose first row is 0 also writes the kept outputs (``pre_keep``);
    the others' member outputs stay in their shared memory (no region). Returns ``tiles``."""
    if not has(op):
        return tiles
    keep = [Region.whole(g, t) for t in op.attrs["pre_keep"]]
    for t in tiles:
        if writer_tile(op, t):
            t.writes += keep
            t.act_bytes += sum((r.stop - r.start) * g.tensors[r.tensor].dtype.itemsize for r in keep)
    return tiles


def writer_tile(op: Op, tile: Tile) -> bool:
    """The tile that writes the kept outputs: the one whose instruction word's p0 (its first
    row, or ``matvec_cols``'s first column) is 0."""
    from fusec.instructions.base import KINDS
    return KINDS[op.kind].encode(op, tile)[0] == 0


def run(op: Op, env: Env) -> torch.Tensor:
    """The members, in order, then the staged vector ``x`` in fp32, flat. Each tile of the
    consumer computes the same (its inputs do not change while the consumer runs), so the
    simulator runs the members for the first tile of a step and keeps the vector (``Env.memo``).

    As on the GPU, only the kept outputs (``pre_keep``) reach global memory: the others' buffers
    are put back as they were before the members ran (gone, or the previous step's values), so
    a reader that should not see them reads poison or a stale value, as it would on the GPU."""
    from fusec.ir.semantics import run_op
    key = f"{op.name}:pre"
    if key not in env.memo:
        g = env.g
        kept = {g.root(t) for t in op.attrs["pre_keep"]}
        with env.scratch({g.root(t) for m in op.attrs["pre"] for t in m.fresh_outputs()} - kept):
            for m in op.attrs["pre"]:
                run_op(m, env)
            env.memo[key] = env.read(op.outputs["x"]).reshape(-1).float().clone()
    return env.memo[key]


def smem_floats(op: Op, g: Graph, own: int) -> int:
    """Shared memory of a consumer with its prologue, in floats: its own ``own`` (the staged x
    at their start), then the members' intermediates and their staged inputs (:func:`layout`)."""
    if not has(op):
        return own
    return max(s.at + s.nbytes for s in layout(op, g, own)) // 4


class Slot(NamedTuple):
    """Where a root buffer's elements ``[start, stop)`` sit in the dynamic shared memory: from
    byte ``at`` (``nbytes`` of them); ``external``: an input staged from global memory."""
    root: str
    start: int
    stop: int
    at: int
    nbytes: int
    external: bool


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def layout(op: Op, g: Graph, own: int) -> list[Slot]:
    """The prologue's shared memory: ``x`` at 0 (where the kind stages its vector); after the
    kind's ``own`` floats, 16-byte aligned, each other member output, then each external input
    (the part of its root the members read, staged once at the start)."""
    x = g.root(op.outputs["x"])
    out = [Slot(x, 0, g.tensors[x].numel, 0, g.tensors[x].nbytes, False)]
    at = _round16(own * 4)
    for m in op.attrs["pre"]:
        for t in m.fresh_outputs():
            r = g.root(t)
            if any(s.root == r for s in out):
                continue
            out.append(Slot(r, 0, g.tensors[r].numel, at, _round16(g.tensors[r].nbytes), False))
            at += out[-1].nbytes
    spans: dict[str, list[int]] = {}
    for t in externals(op):
        r, a, b = g.span(t)
        lo_hi = spans.setdefault(r, [a, b])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], a), max(lo_hi[1], b)
    for r, (a, b) in spans.items():
        out.append(Slot(r, a, b, at, _round16((b - a) * g.tensors[r].dtype.itemsize), True))
        at += out[-1].nbytes
    return out


def scratch_bytes(g: Graph, members: list[Op], ext: list[str], final: str) -> int:
    """Shared memory a prologue of ``members`` takes beyond the kind's own (bytes): every member
    output but ``final`` and every external input, each 16-byte aligned."""
    n = sum(_round16(g.tensors[t].nbytes) for m in members for t in m.fresh_outputs() if g.root(t) != g.root(final))
    return n + sum(_round16(g.tensors[t].nbytes) for t in ext)


class _SmemBufs:
    """A :class:`fusec.cuda.codegen.Buffers` whose prologue tensors live in shared memory: their
    pointer is ``smem`` plus their place (:func:`layout`), and :mod:`fusec.cuda.gen` loads them
    with plain loads (``in_smem``)."""

    def __init__(self, bufs: Any, g: Graph, slots: list[Slot]):
        self._bufs, self._g = bufs, g
        self._where = {s.root: s for s in slots}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bufs, name)

    def in_smem(self, t: str) -> bool:
        return self._g.root(t) in self._where

    def ptr(self, t: str) -> str:
        root, start, _ = self._g.span(t)
        s = self._where.get(root)
        if s is None:
            return self._bufs.ptr(t)
        at = s.at + (start - s.start) * self._g.tensors[root].dtype.itemsize
        return f"(({self._bufs.ctype(t)}*)((char*)smem + {at}))"


def _stage(g: Graph, bufs: Any, slots: list[Slot]) -> str:
    """One loop that copies every external input into shared memory, each thread issuing all
    its loads (16-byte chunks where the part is 16-byte aligned and sized, else elements) before
    its stores: one round trip to L2 for all of them, not one per member."""
    vec, ele = [], []
    for s in slots:
        if not s.external:
            continue
        item = g.tensors[s.root].dtype.itemsize
        nbytes = (s.stop - s.start) * item
        src = f"((const char*)bufs[{bufs.id(s.root)}] + {s.start * item})"
        (vec if nbytes % 16 == 0 and (s.start * item) % 16 == 0 else ele).append((src, s.at, nbytes, item))
    lines = []
    if vec:
        n = max(b // 16 for _, _, b, _ in vec)
        loads = " ".join(f"uint4 v{k} = j < {b // 16} ? __ldcg(reinterpret_cast<const uint4*>({src}) + j) : uint4{{}};"
                         for k, (src, _, b, _) in enumerate(vec))
        stores = " ".join(f"if (j < {b // 16}) reinterpret_cast<uint4*>((char*)smem + {at})[j] = v{k};"
                          for k, (_, at, b, _) in enumerate(vec))
        lines.append(f"for (int j = threadIdx.x; j < {n}; j += blockDim.x) {{ {loads} {stores} }}")
    for src, at, b, item in ele:
        ct = {1: "unsigned char", 2: "unsigned short", 4: "unsigned", 8: "unsigned long long"}[item]
        lines.append(f"for (int j = threadIdx.x; j < {b // item}; j += blockDim.x) "
                     f"(({ct}*)((char*)smem + {at}))[j] = __ldcg(({'const ' + ct}*){src} + j);")
    return " ".join(lines) + " __syncthreads();" if lines else ""


def cuda(op: Op, g: Graph, bufs: Any, own: int) -> dict[str, Any]:
    """The prologue's C statements (``pre``) and the generated functions they call
    (``sources``). ``own``: the kind's own shared memory in floats.

    Two forms, the knob ``FUSEC_PROLOGUE_REGS`` (fusec/cuda/knobs.py) picking one in the
    kernel: the register form (:func:`fusec.instructions.prologue_regs.register_form`) where the
    members allow it, and the shared-memory form: the external inputs staged into shared memory
    (:func:`_stage`), each member's generated function called on shared memory with a barrier
    after it, then the writer tile's copies of the kept outputs to global memory.

    Raises:
        FallbackRequired: a member has no CUDA form (the message names it).
        NotImplementedError: a member's kind has no emitter.
    """
    from fusec.cuda.gen import generate
    slots = layout(op, g, own)
    sb = _SmemBufs(bufs, g, slots)
    parts, sources = [_stage(g, bufs, slots)], []
    for m in op.attrs["pre"]:
        a = generate(m, g, sb)
        sources.append(a)
        parts.append(f"{a['call']}; __syncthreads();")
    copies = []
    for t in op.attrs["pre_keep"]:
        n = g.tensors[t].numel
        copies.append(f"for (int i = threadIdx.x; i < {n}; i += blockDim.x) {bufs.ptr(t)}[i] = {sb.ptr(t)}[i];")
    if copies:
        parts.append("if (in.p0 == 0) { " + " ".join(copies) + " }")
    pre = " ".join(p for p in parts if p) + " "
    from fusec.instructions.prologue_regs import register_form
    regs = register_form(op, g, bufs)
    if regs is not None:
        pre = f"\n#if FUSEC_PROLOGUE_REGS\n{regs['call']}\n#else\n{pre}\n#endif\n"
        sources.append(regs)
    return {"pre": pre, "sources": sources}


class TakesPrologue:
    """Mixin of the consumer kinds (module docstring): ``own_smem`` is the kind's own shared
    memory in floats (its staged x at the start); the prologue's intermediates come after it,
    and its statements come before the kind's call (``pre``, emitted by codegen)."""

    takes_prologue = True

    @classmethod
    def own_smem(cls, op: Op, g: Graph) -> int:
        raise NotImplementedError

    @classmethod
    def smem_floats(cls, op: Op, g: Graph) -> int:
        return smem_floats(op, g, cls.own_smem(op, g))

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs: Any) -> dict[str, Any]:
        args = cls.call.values(op, g, bufs)
        if has(op):
            args.update(cuda(op, g, bufs, cls.own_smem(op, g)))
        return args
