"""Shared row tiling for matvec-based instruction kinds (rows of ``W @ x``)."""
from __future__ import annotations

import torch

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.ir.semantics import rms_normalize
from fusec.instructions.base import CTA_THREADS, Region, Tile, split_range
from fusec.instructions.call import Expr, Flag, Int, Type
from fusec.instructions import prologue


def elt(g: Graph, t: str) -> int:
    """Bytes per element of tensor ``t``."""
    info = g.tensors[g.root(t)]
    return info.nbytes // max(1, info.numel)


def row_tiles(op: Op, g: Graph, want: int, weights: list[str], vec_inputs: list[str],
              row_inputs: list[str], out: str, rows: int, align: int = 1) -> list[Tile]:
    """Tiles over output rows ``[r0, r1)``: each streams rows of every weight in ``weights``.

    Args:
        weights: [rows, K] weight tensors read row-wise.
        vec_inputs: tensors read whole by every tile (the input vector, norm weight).
        row_inputs: [rows] tensors read at the tile's rows (residual, bias); in a batched op
            (:func:`seqs` B > 1) a [B, rows] one (the residual) at the rows of each sequence.
        out: [rows] output written at the tile's rows; [B, rows] in a batched op, written at
            the rows of each sequence (B regions).
    """
    batch = seqs(op)
    tiles = []
    for i, (r0, r1) in enumerate(split_range(rows, want, align)):
        reads, wbytes, abytes = [], 0, 0
        for w in weights:
            k = g.tensors[w].shape[-1]
            reads.append(Region.of(g, w, r0 * k, r1 * k))
            wbytes += (r1 - r0) * k * elt(g, w)
        for v in vec_inputs:
            reads.append(Region.whole(g, v))
            abytes += g.tensors[v].nbytes
        for r in row_inputs:
            for s in range(g.tensors[r].numel // rows if batch > 1 else 1):
                reads.append(Region.of(g, r, s * rows + r0, s * rows + r1))
                abytes += (r1 - r0) * elt(g, r)
        writes = [Region.of(g, out, s * rows + r0, s * rows + r1) for s in range(batch)]
        abytes += batch * (r1 - r0) * elt(g, out)
        tiles.append(Tile(op.name, i, {"rows": [r0, r1]}, reads, writes, wbytes, abytes))
    return tiles


#: the most sequences one matvec op of a batch computes (docs/batch.md): ``row_dot_seqs`` keeps
#: one fp32 accumulator per sequence and lane (templates/matvec_seqs.cu.j2)
MAX_SEQS = 16
#: shared memory (bytes) a batched matvec stages its B input vectors in at most, leaving the rest
#: of the SM's 256 KiB to L1; more sequences than fit are staged in groups (:func:`seq_group`)
STAGE_BYTES = 128 * 1024


def seqs(op: Op) -> int:
    """The sequences B a row-tiled matvec op computes (attribute ``batch``, set by its rule at
    B > 1; absent: one vector, the batch-1 op as it always was)."""
    return op.attrs.get("batch", 1)


def seq_group(batch: int, k: int, elt_bytes: int) -> int:
    """SG, the sequences staged in shared memory at once by a batched matvec (template
    ``matvec_seqs``) of ``batch`` inputs of ``k`` elements of ``elt_bytes`` each; 0 where the
    inputs cannot be staged (the rule then leaves the linear generic: :func:`batch_rows`).

    With F = ``STAGE_BYTES // (k * elt_bytes)`` inputs fitting :data:`STAGE_BYTES`, the batch is
    staged in G = ceil(batch / F) groups of SG = ceil(batch / G): G - 1 groups of SG and a last
    one of the rest (``batch % SG`` where it is not 0, :func:`seq_ranges`), each a sweep of the
    tile's weight rows, so the weights are streamed G times, the fewest that fit (B = 11 at
    Llama-3.2-1B's down projection, K = 8192 bf16: two groups of 6 and 5; a divisor of B would
    have been 11 groups of 1). 0 where one sequence's input is not a whole number of 16-byte
    chunks at B > 1 (a later group's 16-byte staging copies would not be aligned) or does not
    fit :data:`STAGE_BYTES` alone."""
    row = k * elt_bytes
    if batch <= 1:
        return 1
    if row % 16 or row > STAGE_BYTES:
        return 0
    groups = -(-batch // (STAGE_BYTES // row))
    return -(-batch // groups)


def seq_ranges(batch: int, k: int, elt_bytes: int) -> list[tuple[int, int]]:
    """The staged groups of a batched matvec (:func:`seq_group`) as sequence ranges ``[s0, s1)``,
    in the order the template sweeps them: groups of SG, the last one the rest."""
    sg = seq_group(batch, k, elt_bytes)
    if sg < 1:
        raise ValueError(f"{batch} inputs of {k} x {elt_bytes} bytes cannot be staged (seq_group)")
    return [(s0, min(s0 + sg, batch)) for s0 in range(0, batch, sg)]


def batch_rows(g: Graph, m: dict) -> int:
    """For a rule's check (bindings ``m`` with ``x`` and ``w``): the rows M of the linear's ``x``
    ([M, K], K the weight ``w``'s last dim) where they are 1 or the step's activation rows
    R = B·K (:meth:`fusec.ir.Graph.rows`: B sequences of K query tokens each, docs/batch.md) of
    at most :data:`MAX_SEQS` whose inputs ``matvec_seqs`` can stage (:func:`seq_group` > 0); 0
    otherwise (a linear over some other number of rows, too many rows, not a whole number of
    rows, or inputs that cannot be staged: the linear stays generic). The R rows of a K-token
    step are computed as the sequences of a batch are: each its own input row and output row
    (``x`` [B, K, H] flattens to [R, H] row-major, ``out`` [R, N] likewise)."""
    w = g.tensors[m["w"]]
    if len(w.shape) != 2:
        return 0
    n, k = g.tensors[m["x"]].numel, w.shape[1]
    if n == k:
        return 1
    if n % k or n // k > MAX_SEQS or n // k != g.rows() or not seq_group(n // k, k, elt(g, m["x"])):
        return 0
    return n // k


def fused_batch(g: Graph, x: str, k: int, elt_bytes: int) -> int:
    """For the rules of the fused RMSNorm kinds (``rms_qkv_rope``, ``rms_gate_up_silu``:
    docs/batch.md): the activation rows R their op computes over ``x``, rows of ``k`` elements
    staged as ``elt_bytes`` each: 1 in a step of one row (x of ``k`` elements); the step's rows
    R = B·K (:meth:`fusec.ir.Graph.rows`: B sequences of K query tokens each) where x is
    ``[R, k]`` (``[B, K, k]`` flattens to it row-major), R <= :data:`MAX_SEQS`, and all R rows
    are staged at once (:func:`seq_group` is R: these kinds stage one group); 0 otherwise (x of
    some other number of rows, rows that do not fit: the subgraph stays batched matvecs and
    generic ops). Each row is computed as one sequence of a batch (its own RMSNorm)."""
    n, r = g.tensors[x].numel, g.rows()
    if n != r * k:
        return 0
    if r == 1:
        return 1
    return r if r <= MAX_SEQS and seq_group(r, k, elt_bytes) == r else 0


def batch_attrs(g: Graph, m: dict) -> dict:
    """A rule's attributes of a row-tiled matvec op: ``batch`` B where x has B > 1 rows (none at
    batch 1: the op is the one of before)."""
    b = batch_rows(g, m)
    return {"batch": b} if b > 1 else {}


def batched(op: Op) -> bool:
    """Whether ``op`` computes a batch of sequences (:func:`seqs` > 1)."""
    return seqs(op) > 1


def single(op: Op) -> bool:
    """Whether ``op`` computes one vector (the batch-1 op)."""
    return seqs(op) == 1


def seq_fn(name: str):
    """A kind's device function: ``name`` at batch 1, ``matvec_seqs`` for a batch."""
    return lambda op: "matvec_seqs" if batched(op) else name


def _k(op: Op, g: Graph) -> int:
    return g.tensors[op.inputs["w"]].shape[1]


#: ``matvec_seqs``'s template arguments N (output rows), B and SG (:func:`seq_group`: groups of SG
#: sequences, the last one of the rest), between K and BIAS; passed only for a batch
SEQ_ARGS = (Int("N", lambda op, g: g.tensors[op.inputs["w"]].shape[0], when=batched),
            Int("B", lambda op, g: seqs(op), when=batched),
            Int("SG", lambda op, g: 0 if global_x(op, g) else seq_group(seqs(op), _k(op, g), elt(g, prologue.xin(op))),
                when=batched))


#: the dtypes whose batched matvec runs on the tensor cores (:func:`mma`)
MMA_DTYPES = (torch.bfloat16, torch.float16)


def mma(op: Op, g: Graph) -> bool:
    """Whether a batched matvec op takes ``matvec_seqs``'s tensor-core path (template flag ``MMA``:
    ``mma.sync`` m16n8k16 with fp32 accumulators, docs/batch.md "Speed"): its weight and its
    staged input (x, or a folded prologue's result) share one dtype of :data:`MMA_DTYPES`. fp32
    weights keep the CUDA-core FMAs (no TF32: fp32 products and sums stay fp32)."""
    dt = g.tensors[op.inputs["w"]].dtype
    return dt in MMA_DTYPES and g.tensors[prologue.xin(op)].dtype == dt


#: ``matvec_seqs``'s template argument MMA (:func:`mma`), after ``RES``; passed only for a batch
MMA = Expr("mma", lambda op, g, bufs: "true" if mma(op, g) else "false", when=batched)


def global_x(op: Op, g: Graph) -> bool:
    """Whether a batched matvec on the tensor cores (:func:`mma`) reads its B inputs from global
    memory (L2) with its weights instead of staging them (``matvec_seqs``'s SG 0, template
    ``mma_rows_gx``): where they do not fit :data:`STAGE_BYTES` at once (:func:`seq_group` < B:
    Llama-3.2-1B's down projection, K = 8192 bf16, at B > 8), which would stream the weights once
    per staged group; not with a folded prologue (it stages all B itself)."""
    if not batched(op) or not mma(op, g) or prologue.has(op):
        return False
    return seq_group(seqs(op), _k(op, g), elt(g, prologue.xin(op))) < seqs(op)


def mma_smem(op: Op, g: Graph) -> int:
    """Shared memory (floats) the tensor-core path's partial sums take (in place of the staged
    inputs, after every warp is done with them): one warp's MMA fragments (128 floats per 8
    sequences of the largest group; all B where :func:`global_x`) per warp of the CTA."""
    group = seqs(op) if global_x(op, g) else seq_group(seqs(op), _k(op, g), elt(g, prologue.xin(op)))
    return CTA_THREADS // 32 * 128 * -(-group // 8)


def pair_smem(op: Op) -> int:
    """Shared memory (floats) a batched fused kind (``rms_gate_up_silu``, ``rms_qkv_rope`` at B > 1)
    reserves after its staged rows for ``pairs_seqs``'s partial sums (templates/seqs_rows.cu.j2
    ``mma_pairs``: one warp's MMA fragments, 128 floats per 8 rows, per warp of the CTA); 0 at
    batch 1. Reserved whatever the dtypes (fp32 weights take the CUDA-core path and leave it unused)."""
    return CTA_THREADS // 32 * 128 * -(-seqs(op) // 8) if batched(op) else 0


def seq_smem(op: Op, g: Graph) -> int:
    """Shared memory (floats) of a row-tiled matvec that stages x itself: K at batch 1 (as
    before batches), a batch's staged group of :func:`seq_group` inputs (bytes rounded up), at
    least the tensor-core path's partial sums (:func:`mma_smem`) where it takes that path; only
    those where it reads its inputs from global memory (:func:`global_x`)."""
    k = _k(op, g)
    if single(op):
        return k
    if global_x(op, g):
        return mma_smem(op, g)
    e = elt(g, prologue.xin(op))
    staged = -(-seq_group(seqs(op), k, e) * k * e // 4)
    return max(staged, mma_smem(op, g)) if mma(op, g) else staged


def seq_uses(op: Op, args: dict) -> dict:
    """``args`` with the batch's template definition (``uses``: templates/matvec_seqs.cu.j2) for a
    batched op; a batch-1 op's kernel renders without it."""
    if batched(op):
        args["uses"] = ("matvec_seqs",)
    return args


def rows_dot(op: Op, env: Env, r0: int, r1: int) -> torch.Tensor:
    """The rows ``[r0, r1)`` of a row-tiled matvec kind's product (inputs ``w``, ``x``) for each of
    its sequences, in fp32 (unrounded): [B, r1 - r0] (B = :func:`seqs`, 1 at batch 1). Batch 1:
    ``W[r0:r1] @ x``, x the staged vector (:func:`staged`: a folded prologue's result, else x); a
    batch: ``x [B, K] @ W[r0:r1]^T`` group by staged group as ``matvec_seqs`` sweeps them
    (:func:`seq_ranges`; each output is one fp32 dot whatever its group)."""
    w = env.read(op.inputs["w"])[r0:r1].float()
    if single(op):
        return (w @ staged(op, env, False))[None]
    x = staged(op, env, False).reshape(seqs(op), w.shape[1])
    return torch.cat([x[s0:s1] @ w.T for s0, s1 in seq_ranges(seqs(op), w.shape[1], elt(env.g, prologue.xin(op)))])


def staged(op: Op, env: Env, norm: bool) -> torch.Tensor:
    """The vector a row-tiled kind stages, fp32 [H] (a batched op's B inputs, flat [B * H]): its
    folded prologue's result (:mod:`fusec.instructions.prologue`), else RMSNorm(x) (``norm``),
    else x."""
    if prologue.has(op):
        return prologue.run(op, env)
    if norm:
        return rms_prologue(op, env)
    return env.read(op.inputs["x"]).reshape(-1).float()


def rms_attrs(g: Graph, rms: Op) -> dict:
    """The attributes a fused kind takes from the ``rmsnorm`` op it absorbs (its eps and the
    dtype its output had)."""
    return {"eps": rms.attrs["eps"], "norm_dtype": g.tensors[rms.outputs["out"]].dtype}


def rms_types(w: str, out: str = "out") -> tuple:
    """The template arguments the RMSNorm-prologue kinds start with: TX, TNW, TN (the norm's
    output dtype), TW (weight ``w``), TO (output ``out``)."""
    return (Type("tx", "x"), Type("tnw", "norm_w", otherwise="float"), Expr("tn", lambda op, g, bufs: bufs.cname(op.attrs["norm_dtype"])),
            Type("tw", w), Type("to", out))


#: H: the hidden size (elements of x; of one sequence's row in a batched op, :func:`seqs`)
HIDDEN = Int("H", lambda op, g: g.tensors[prologue.xin(op)].numel // seqs(op))


#: WF32: the norm weight applied in fp32 (Gemma); C++ default false
WF32 = Flag("wf32", fn=lambda op: op.attrs.get("w_fp32", False), default="false")


def normed(op: Op) -> bool:
    """Whether an RMSNorm-prologue kind norms x itself (attr ``norm``, default True): False where
    no RMSNorm makes its input (a post-norm MLP, a LayerNorm folded in as its prologue)."""
    return op.attrs.get("norm", True)


#: NORM: the kind norms x itself (:func:`normed`); false: x staged as it is; C++ default true
NORM = Flag("norm", fn=normed, default="true")


def rms_prologue(op: Op, env: Env):
    """RMSNorm of ``op.inputs["x"]`` with ``norm_w``/``eps``, recomputed per tile; fp32 [H]
    (a batched op's B rows each with its own sum of squares, flat [B * H])."""
    if batched(op):
        x = env.read(op.inputs["x"]).reshape(seqs(op), -1)
        return rms_normalize(x, env.read(op.inputs["norm_w"]), op.attrs["eps"], op.attrs["norm_dtype"],
                             op.attrs.get("w_fp32", False)).float().reshape(-1)
    x = env.read(op.inputs["x"]).reshape(-1)
    return rms_normalize(x, env.read(op.inputs["norm_w"]), op.attrs["eps"], op.attrs["norm_dtype"],
                         op.attrs.get("w_fp32", False)).float()
