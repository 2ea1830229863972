"""rms_qkv_rope: RMSNorm + Q/K/V rows + (per-head q/k RMSNorm) + RoPE + KV-cache append.

One tile owns a range of heads over the concatenation [q heads | k heads | v heads]. It
recomputes the RMSNorm of x (a few KB; with ``norm`` False, where no RMSNorm makes the q/k/v's
input, it stages x as it is, or a folded prologue computes it: a LayerNorm), multiplies its weight rows, applies the optional
per-head RMSNorm (Qwen3 ``q_norm``/``k_norm``) and RoPE (Su et al. 2021, half-split layout,
cos/sin looked up at the position in tables folded at compile time), then writes q heads to
``q`` and k/v heads into row ``kv_pos`` of the KV caches.

With a per-head norm a head needs all its projections, so by default a tile holds whole heads
(Qwen3-0.6B: 32 tiles of 256 KiB per layer, on 32 of 132 SMs). When ``want`` leaves room for
several tiles per head, each head's rotation pairs are split over ``pieces`` tiles instead: a
q/k piece stores its projections (rounded, fp32) in ``qk_part`` [Hq+Hkv, D] and takes an atomic
ticket of its head (spare counters, as the split-KV merge); the tile that takes the head's last
ticket of the step norms, rotates and stores the whole head. A v piece stores its rows.

Partial rotary embeddings (GPT-NeoX ``rotary_pct``, Phi-2 and StableLM ``partial_rotary_factor``;
attribute ``rotary_dim`` rd < D, from the ``rope`` ops' own, recognized in
:mod:`fusec.passes.recognize`): only the first rd values of each q/k head are rotated, with the
pairs (i, i + rd/2), cos/sin tables rd wide; the other D - rd values are the projection's rounded
outputs as they are (HF's ``cat((q_rot, q_pass), -1)``). A work unit is still a pair of rows: unit
p < rd/2 is the rotation pair (p, p + rd/2), unit p >= rd/2 the pass-through rows
(p + rd/2, p + D/2) (:func:`pair_rows`). Not with a per-head norm (no such family).

The q/k RMSNorms, per head or over the whole projection, take one eps for q and k (``qk_eps``)
and one weight order: attribute ``qk_w_fp32`` where the weight multiplies in fp32 before the one
rounding (the ``rmsnorm``'s ``w_fp32``: Gemma-3's per-head ``(1 + w)``, HF's ``Gemma3RMSNorm``;
OLMo-2's ``Olmo2RMSNorm``), else Llama's order (the normed value rounded, then the weight).

A q/k RMSNorm over the whole projection (OLMo-2's ``q_norm`` over all Hq*D values of q with a
weight of Hq*D, ``k_norm`` over Hkv*D; attribute ``qk_norm`` "proj"): one sum of squares over every
head, so no tile that owns a head range can norm its heads alone. The units are tiled as without
a norm (any pair boundary); a tile's q/k units store their projections (rounded, fp32) in
``qk_part`` [Hq+Hkv, D] and its v units their cache rows; then every tile that holds q/k units
takes one atomic ticket (one counter for the op), and the tile that takes the step's last one
norms all of q (one sum of squares over Hq*D values) and all of k (over Hkv*D), rotates them and
stores q and the k cache rows. Chosen over the alternative (the norm as a row reduction tiled
over SMs, then a RoPE tile: two dependency levels after the projections) because it keeps the
q/k/v, the norms, RoPE and the KV writes one level, as Llama's: the finishing tile's extra work
is (Hq+Hkv)*D values from L2 (4096 at OLMo-2-1B) against the projections' megabytes. One ticket
for q and k together (not one each): a tile holds a q/k unit range, the template needs one
count of the tiles that take it (``pieces`` in this mode), and the second norm on the same tile
costs a block reduction, not a level.

A fused q/k/v projection cut after the product (:mod:`fusec.ir.pieces`): Falcon-7B's single row
ranges reach this kind as separate linears over row views (``split_linear``); GPT-NeoX's pieces,
interleaved per head (rows ``h * 3D + j * D + [0, D)`` for piece j), are read here as views of
the fused weight and bias starting at each piece's first row, with attribute ``w_stride`` (3D):
head h's rows start at ``h * w_stride`` of its view (template ``WS``; q and the caches keep D).
How the graph is read (the pattern and its conditions): :mod:`fusec.instructions.qkv_match`.

Shapes: x [H]; norm_w [H]; wq [Hq*D, H]; wk, wv [Hkv*D, H] (with ``w_stride`` S: [(Hq-1)*S + D, H],
[(Hkv-1)*S + D, H]); optional biases bq [Hq*D], bk, bv [Hkv*D] (likewise) (Qwen2: ``addmm``, the
bias added to the fp32 dot before the projection's rounding);
cos_table, sin_table [L, .., rd] (rd = D without ``rotary_dim``); kcache, vcache [1, Hkv, L, D];
q [Hq*D]. Numerics: fp32 math,
rounded to the model dtype where PyTorch rounds (after the norm, after each projection, after
RoPE). The caches' rows L may be a run-time length (:attr:`fusec.ir.TensorInfo.sym`): the
template takes it as an argument (:meth:`fusec.cuda.codegen.Buffers.length`) for the row's
address and its check; the tables keep the capacity's rows.

A batch of B <= 16 sequences of one query token each (docs/batch.md; attribute ``batch``, set by
the matcher: :func:`fusec.instructions.qkv_match.match_qkv`): x [B, H], q [B, Hq*D], caches
[B, Hkv, L, D] written at the one row ``kv_pos`` (HF's StaticCache: one cache position for every
sequence), cos/sin either the tables at ``rope_pos`` (shared) or, with no ``rope_pos``
(:func:`seq_rope`), the step's own rows [B, rd], sequence s reading row s (its own position:
left-padded prompts). The tiles are batch 1's units; each weight row is loaded once for the B
sequences (template ``rms_qkv_rope_seqs``, templates/rms_qkv_rope_seqs.cu.j2: a unit's two rows
dotted with the B rows by ``pairs_seqs`` of templates/seqs_rows.cu.j2, on the tensor cores in
bf16/fp16), each sequence's RMSNorm its own.

A step of B sequences of K > 1 query tokens each (speculative decoding's verification) is R = B·K
rows, computed as a batch of R (attributes ``batch`` R and ``tokens`` K; template argument ``KT``):
row s is sequence s // K's token s % K; x [R, H]; q [B, Hq, K, D] (HF's q after its transpose and
RoPE: the op absorbs the transpose), written at ``((b * Hq + head) * K + k) * D``; k/v heads to
cache row ``kv_pos[k]`` of sequence b (kv_pos [K], HF's ``cache_position``, shared by the
sequences); cos/sin either the step's rows [R, rd] (no ``rope_pos``) or a table's row
``rope_pos[k]`` (rope_pos [K]: the K rows that the sequences share, ``rope_pos`` 0 .. K - 1).
Batch 1 only:
the head split into pieces with tickets (a per-head norm takes whole heads at B > 1) and the
q/k norms over the whole projection (refused by the matcher).
"""
from __future__ import annotations

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.instructions.base import Instruction, Region, Tile, register, split_range
from fusec.instructions.call import P0, P1, P2, RED, SMEM, Call, Expr, Flag, Float, Int, Ptr, Type
from fusec.instructions.matvec_rows import (HIDDEN, MAX_SEQS, NORM, WF32, batched, elt, normed, pair_smem, rms_types,
                                            seqs)
from fusec.instructions.prologue import STAGED, TakesPrologue, adjust_tiles, externals, has, xin
from fusec.instructions.qkv_match import match_qkv, proj_norm, rotary_dim, seq_rope, tokens, w_stride
from fusec.instructions.rms_qkv_rope_sim import QkvRopeTiles
from fusec.instructions.rule import Rule


def _bias_or_wf32(op: Op) -> bool:
    return "bq" in op.inputs or bool(op.attrs.get("w_fp32"))


def _explicit(op: Op) -> bool:
    """BIAS and TB are written out: a later template argument (WF32, NORM, STAGED, RD, PROJNORM,
    QKW32, WS, KT) differs from its default (they have no C++ default before WF32, so leaving
    them out would shift every later argument)."""
    return _bias_or_wf32(op) or has(op) or not normed(op) or "rotary_dim" in op.attrs or proj_norm(op) \
        or "w_stride" in op.attrs or bool(op.attrs.get("qk_w_fp32")) or tokens(op) > 1


def pair_rows(d: int, rd: int, p0: int, p1: int) -> list[tuple[int, int]]:
    """The rows of one head (of ``d``) that the units ``[p0, p1)`` compute, as row ranges: unit
    p < rd/2 the rotation pair (p, p + rd/2); unit p >= rd/2 (partial rotary, ``rd`` < d) the
    pass-through rows (p + rd/2, p + d/2). Units 0 .. d/2 cover rows 0 .. d once each."""
    r, half, out = rd // 2, d // 2, []
    a, b = p0, min(p1, r)
    if b > a:
        out += [(a, b), (r + a, r + b)]
    a, b = max(p0, r), p1
    if b > a:
        out += [(a + r, b + r), (a + half, b + half)]
    return out


def staged_floats(op: Op, g: Graph) -> int:
    """A batched op's staged x, ``[B, H]`` in the staged dtype (the norm's output or x's own:
    attribute ``norm_dtype``), in floats rounded up to 16 bytes: where the head scratch starts
    (templates/rms_qkv_rope_seqs.cu.j2)."""
    nbytes = g.tensors[xin(op)].numel * op.attrs["norm_dtype"].itemsize
    return -(-nbytes // 16) * 4


@register
class RmsQkvRope(TakesPrologue, QkvRopeTiles, Instruction):
    name = "rms_qkv_rope"
    #: R = B·K <= 16 rows: B sequences of K query tokens (attributes ``batch`` R, ``tokens`` K: docs/batch.md)
    max_rows = MAX_SEQS
    #: first of all rules: it needs the ``attention`` op (to find the q and the caches) unsplit
    rules = (Rule(match=match_qkv, anchors=("attention",), priority=10),)

    @classmethod
    def _layout(cls, op: Op, g: Graph):
        """(n_q, n_kv, head_dim, L): L the caches' rows in the graph (the capacity of a run-time
        length; ``env.length`` at run time)."""
        a = op.attrs
        return a["n_q"], a["n_kv"], a["head_dim"], g.tensors[op.outputs["kcache"]].shape[2]

    @classmethod
    def _units(cls, op: Op, g: Graph):
        """(units, units per head, alignment): the work units over [q | k | v] heads, D/2 per
        head; unit p of a head computes two of its rows (:func:`pair_rows`: the rotation pair
        (p, p + rd/2), or past rd/2 two pass-through rows). A per-head norm aligns tiles to whole
        heads."""
        nq, nkv, d, L = cls._layout(op, g)
        half = d // 2
        # a per-head norm needs whole heads; one over the whole projection any pair boundary
        align = half if "q_norm_w" in op.inputs and not proj_norm(op) else 1
        return (nq + 2 * nkv) * half, half, align

    @classmethod
    def _spans(cls, op: Op, g: Graph, u0: int, u1: int):
        """(head, p0, p1) pieces of the unit range [u0, u1)."""
        _, half, _ = cls._units(op, g)
        for h in range(u0 // half, (u1 - 1) // half + 1):
            yield h, max(u0 - h * half, 0), min(u1 - h * half, half)

    @classmethod
    def _pieces(cls, op: Op, g: Graph, want: int) -> int:
        """Tiles per head: 1 (whole heads) unless the op has a per-head norm and ``want`` tiles
        leave room for several per head; then each head's rotation pairs are split over that many
        tiles, and the head's last tile (a ticket) norms and rotates it."""
        nq, nkv, d, _ = cls._layout(op, g)
        if "qk_part" not in op.outputs or proj_norm(op):
            return 1
        return max(1, min(want // (nq + 2 * nkv), d // 2))

    @classmethod
    def _ranges(cls, op: Op, g: Graph, want: int) -> list[tuple[int, int]]:
        n_units, half, align = cls._units(op, g)
        s = cls._pieces(op, g, want)
        if s == 1:
            return split_range(n_units, want, align)
        return [(h * half + a, h * half + b) for h in range(n_units // half) for a, b in split_range(half, s)]

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        nq, nkv, d, L = cls._layout(op, g)
        n_units, half, align = cls._units(op, g)
        hid = g.tensors[op.inputs["wq"]].shape[1]
        ws = w_stride(op)
        vec = [op.inputs[s] for s in ("x", "norm_w", "cos_table", "sin_table", "rope_pos", "kv_pos",
                                      "q_norm_w", "k_norm_w", "bq", "bk", "bv") if s in op.inputs]
        if has(op):   # a folded prologue: its inputs instead of x and the norm's weight
            vec = externals(op) + vec
        pieces = cls._pieces(op, g, want)
        proj = proj_norm(op)
        nrows, kt = seqs(op), tokens(op)   # R = B·K rows: each row's q rows, each sequence's cache rows
        ranges = cls._ranges(op, g, want)
        n_qk = sum(1 for u0, _ in ranges if u0 < (nq + nkv) * half)   # proj: the tiles that take the ticket
        vec_bytes = sum(g.tensors[v].nbytes for v in vec if g.tensors[g.root(v)].role.value != "constant")
        tiles = []
        for i, (u0, u1) in enumerate(ranges):
            reads = [Region.whole(g, v) for v in vec]
            writes, wbytes, split = [], 0, False
            for h, p0, p1 in cls._spans(op, g, u0, u1):
                w, out, row = cls._head(op, h, nq, nkv)
                # a piece of a q/k head (or, proj, its units): pre-norm values, then maybe the head (all q and k)
                piece = (pieces > 1 or proj) and h < nq + nkv
                split |= piece
                for a, b in cls._rows(op, p0, p1):
                    reads.append(Region.of(g, op.inputs[w], (row * ws + a) * hid, (row * ws + b) * hid))
                    wbytes += (b - a) * hid * elt(g, op.inputs[w])
                    if piece:
                        writes.append(Region.of(g, op.outputs["qk_part"], h * d + a, h * d + b))
                    elif out == "q":
                        writes += [Region.of(g, op.outputs["q"], cls._q_at(op, s, row) + a, cls._q_at(op, s, row) + b)
                                   for s in range(nrows)]
                if piece and not proj:   # the head's last piece reads all its pre-norm values
                    reads.append(Region.of(g, op.outputs["qk_part"], h * d, (h + 1) * d))
                if (piece and not proj) or (not piece and out != "q"):   # the whole head (or its cache rows)
                    writes += [cls._head_out(op, g, h, s=s) for s in range(0, nrows, kt if out != "q" else 1)]
            qk = proj and u0 < (nq + nkv) * half
            if qk:   # the last q/k tile reads every pre-norm value and writes all of q and of k
                reads.append(Region.whole(g, op.outputs["qk_part"]))
                writes += [Region.whole(g, op.outputs["q"]), Region.whole(g, op.outputs["kcache"])]
            abytes = vec_bytes + (2 * (u1 - u0) * 4 + ((nq + nkv) * d * (4 + elt(g, xin(op)))) // n_qk if qk
                                  else 2 * (u1 - u0) * 4 + (d * 4 + d * elt(g, xin(op))) // pieces if split
                                  else nrows * 2 * (u1 - u0) * 2 * elt(g, xin(op)))
            params = {"units": [u0, u1], "pieces": pieces}
            if proj:
                params["qk_tiles"] = n_qk
            tiles.append(Tile(op.name, i, params, _merge(reads), _merge(writes), wbytes, abytes))
        return adjust_tiles(op, g, tiles)

    @classmethod
    def _q_at(cls, op: Op, s: int, row: int) -> int:
        """The flat offset of q head ``row`` of the op's row ``s`` in ``q`` [B, Hq, K, D]
        (sequence s // K, token s % K; K = 1: [B, Hq*D])."""
        nq, d, kt = op.attrs["n_q"], op.attrs["head_dim"], tokens(op)
        b, k = divmod(s, kt)
        return ((b * nq + row) * kt + k) * d

    @classmethod
    def _head_out(cls, op: Op, g: Graph, h: int, pos: int | None = None, L: int | None = None,
                  s: int = 0) -> Region:
        """Where q/k/v head ``h`` of the op's row ``s`` (0 at batch 1; sequence s // K's token
        s % K) goes: its q rows, or its sequence's KV head's cache row at position ``pos`` (the
        token's; None: every position, as planned, since the row depends on the run-time
        position) of a cache of ``L`` rows (None: the graph's)."""
        nq, nkv, d, L_g = cls._layout(op, g)
        L = L_g if L is None else L
        _, out, row = cls._head(op, h, nq, nkv)
        if out == "q":
            return Region.of(g, op.outputs["q"], cls._q_at(op, s, row), cls._q_at(op, s, row) + d)
        base = (s // tokens(op) * nkv + row) * L * d
        return Region.of(g, op.outputs[out], base + pos * d, base + (pos + 1) * d) if pos is not None else \
            Region.of(g, op.outputs[out], base, base + L * d)

    @classmethod
    def _rows(cls, op: Op, p0: int, p1: int) -> list[tuple[int, int]]:
        """The row ranges of one head that its units ``[p0, p1)`` compute (:func:`pair_rows`)."""
        return pair_rows(op.attrs["head_dim"], rotary_dim(op), p0, p1)

    @classmethod
    def encode(cls, op: Op, tile: Tile) -> list[int]:
        """(u0, u1, pieces): the tile's units and its head's pieces; with a norm over the whole
        projection, instead of the pieces, the count of the tiles that take the q/k ticket."""
        if proj_norm(op):
            return [*tile.params["units"], tile.params["qk_tiles"]]
        return [*tile.params["units"], tile.params.get("pieces", 1)]

    #: batch 1: ``rms_qkv_rope``; R = B·K > 1 rows: ``rms_qkv_rope_seqs``
    #: (templates/rms_qkv_rope_seqs.cu.j2), which takes R (its B), whether the cos/sin are per row
    #: too and, last, KT = K (passed only at K > 1; BIAS and TB are then written out: ``_explicit``)
    call = Call(lambda op: "rms_qkv_rope_seqs" if batched(op) else "rms_qkv_rope",
                targs=(*rms_types("wq", "q"), Type("tt", "cos_table"), Type("tc", "kcache"),
                       Type("thn", "q_norm_w", "norm_w", otherwise="float"), HIDDEN, Int("NQ", lambda op, g: op.attrs["n_q"]),
                       Int("NKV", lambda op, g: op.attrs["n_kv"]), Int("D", lambda op, g: op.attrs["head_dim"]),
                       Int("RP", lambda op, g: g.tensors[op.inputs["cos_table"]].shape[0]),
                       Int("B", lambda op, g: seqs(op), when=batched), Flag("seqrope", fn=seq_rope, when=batched),
                       Flag("headnorm", has="q_norm_w"),
                       # BIAS and TB are passed for the bias, fp32-weight-norm and staged variants
                       Flag("bias", has="bq", when=_explicit), Type("tb", "bq", "wq", when=_explicit), WF32,
                       NORM, STAGED,
                       # the rotated values per head (partial rotary); 0: the whole head
                       Int("RD", lambda op, g: op.attrs.get("rotary_dim", 0), default=0),
                       # q/k norms over the whole projection (OLMo-2), their weight in fp32
                       Flag("projnorm", fn=proj_norm, default="false"),
                       Flag("qkw32", fn=lambda op: op.attrs.get("qk_w_fp32", False), default="false"),
                       # rows between two heads' first rows in a fused weight (GPT-NeoX: 3 * D); 0: D
                       Int("WS", lambda op, g: op.attrs.get("w_stride", 0), default=0),
                       # query tokens per sequence (rows B·KT: row s is sequence s / KT's token s % KT)
                       Int("KT", lambda op, g: tokens(op), default=1, when=batched)),
                args=(Ptr("x"), Ptr("norm_w"), Float("eps", "eps", fallback=0.0), Ptr("wq"), Ptr("wk"), Ptr("wv"),
                      Ptr("cos_table"), Ptr("sin_table"), Ptr("rope_pos"), Ptr("kv_pos"), Ptr("q"), Ptr("kcache"),
                      Ptr("vcache"), Ptr("q_norm_w"), Ptr("k_norm_w"), Float("qk_eps", "qk_eps", 0.0),
                      # the caches' rows: a literal, or the run-time length's slot
                      Expr("L", lambda op, g, bufs: bufs.length(op.outputs["kcache"], 2)), P0, P1, P2,
                      SMEM, RED, Ptr("qk_part", default="nullptr"),
                      Expr("tickets", lambda op, g, bufs: bufs.counters(
                          op.name, 1 if proj_norm(op) else op.attrs["n_q"] + op.attrs["n_kv"])
                           if "qk_part" in op.outputs else "nullptr", default="nullptr"),
                      Ptr("bq", default="nullptr"), Ptr("bk", default="nullptr"), Ptr("bv", default="nullptr")),
                numbering=("q_norm_w", "k_norm_w", "bq", "bk", "bv", "x", "norm_w", "wq", "wk", "wv",
                           "cos_table", "sin_table", "rope_pos", "kv_pos", "q", "kcache", "vcache", "qk_part"))

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs) -> dict:
        if g.tensors[g.root(op.outputs["kcache"])].shape[0] * tokens(op) != seqs(op):
            raise NotImplementedError("rms_qkv_rope: the KV caches' batch must be the op's sequences")
        if bufs.symbol(op.outputs["kcache"], 2) != bufs.symbol(op.outputs["vcache"], 2):
            raise NotImplementedError("rms_qkv_rope: K and V caches of different run-time lengths")
        args = super().cuda_args(op, g, bufs)
        if batched(op):   # the batched dot (matvec_seqs, seqs_rows) and the kind's batch template
            args["uses"] = ("matvec_seqs", "seqs_rows", "rms_qkv_rope_seqs")
        return args

    @classmethod
    def own_smem(cls, op: Op, g: Graph) -> int:
        """Floats: batch 1, x (H, as floats) and one head's projections (D); a batch, the staged
        ``[B, H]`` (:func:`staged_floats`), with a per-head norm B heads' projections, then the
        partial sums of its pairs of rows (:func:`fusec.instructions.matvec_rows.pair_smem`)."""
        if batched(op):
            return staged_floats(op, g) + (seqs(op) * op.attrs["head_dim"] if "q_norm_w" in op.inputs else 0) \
                + pair_smem(op)
        return g.tensors[xin(op)].numel + op.attrs["head_dim"]

    @staticmethod
    def _head(op: Op, h: int, nq: int, nkv: int) -> tuple[str, str, int]:
        if h < nq:
            return "wq", "q", h
        if h < nq + nkv:
            return "wk", "kcache", h - nq
        return "wv", "vcache", h - nq - nkv

    @classmethod
    def _split(cls, op: Op, tile: Tile) -> int | None:
        """The q/k head of a tile that holds a piece of it (the head's tiles take tickets), else None."""
        nq, nkv = op.attrs["n_q"], op.attrs["n_kv"]
        h = tile.params["units"][0] // (op.attrs["head_dim"] // 2)
        return h if tile.params.get("pieces", 1) > 1 and h < nq + nkv and not proj_norm(op) else None

    @classmethod
    def _takes_qk(cls, op: Op, tile: Tile) -> bool:
        """With a norm over the whole projection: whether the tile holds q/k units (takes the ticket)."""
        a = op.attrs
        return proj_norm(op) and tile.params["units"][0] < (a["n_q"] + a["n_kv"]) * (a["head_dim"] // 2)

    @classmethod
    def _is_last_qk(cls, op: Op, tile: Tile, env: Env, peek: bool = False) -> bool:
        """Whether this tile's q/k ticket (a norm over the whole projection) is the step's last."""
        key, n = (op.name, "qk"), tile.params["qk_tiles"]
        t = env.peek_ticket(key) if peek else env.take_ticket(key)
        return t % n == n - 1

    @classmethod
    def _is_last(cls, op: Op, tile: Tile, env: Env, h: int, peek: bool = False) -> bool:
        """Whether this tile's ticket of head ``h`` is the step's last (takes it unless ``peek``)."""
        key, n = (op.name, h), tile.params["pieces"]
        t = env.peek_ticket(key) if peek else env.take_ticket(key)
        return t % n == n - 1

    @classmethod
    def ticket_regions(cls, op, tile, env):
        """A split head's norm and RoPE, after the ticket: the head's pre-norm values and its
        output, if this tile's ticket is the head's last of the step. With a norm over the whole
        projection: every q/k pre-norm value, all of q and the k caches' rows at the position, if
        the tile's q/k ticket is the step's last."""
        if cls._takes_qk(op, tile):
            if not cls._is_last_qk(op, tile, env, peek=True):
                return [], []
            g, nq, nkv = env.g, op.attrs["n_q"], op.attrs["n_kv"]
            pos = int(env.read(op.inputs["kv_pos"]).reshape(-1)[0])
            L = env.length(op.outputs["kcache"], 2)
            return ([Region.whole(g, op.outputs["qk_part"])],
                    [Region.whole(g, op.outputs["q"])] + [cls._head_out(op, g, h, pos, L) for h in range(nq, nq + nkv)])
        h = cls._split(op, tile)
        if h is None or not cls._is_last(op, tile, env, h, peek=True):
            return [], []
        d = op.attrs["head_dim"]
        pos = int(env.read(op.inputs["kv_pos"]).reshape(-1)[0])
        return ([Region.of(env.g, op.outputs["qk_part"], h * d, (h + 1) * d)],
                [cls._head_out(op, env.g, h, pos, env.length(op.outputs["kcache"], 2))])

    @classmethod
    def runtime_regions(cls, op, tile, env):
        nq, nkv, d, _ = cls._layout(op, env.g)
        L = env.length(op.outputs["kcache"], 2)
        half = d // 2
        pos = env.read(op.inputs["kv_pos"]).reshape(-1).tolist()   # one per query token
        kt = tokens(op)
        h = cls._split(op, tile)
        if h is not None:   # before the ticket: the piece's pre-norm values
            part = env.g.root(op.outputs["qk_part"])
            u0, u1 = tile.params["units"]
            a, b = u0 % half, (u1 - 1) % half + 1
            return ([r for r in tile.reads if r.tensor != part],
                    [Region.of(env.g, op.outputs["qk_part"], h * d + a, h * d + b),
                     Region.of(env.g, op.outputs["qk_part"], h * d + half + a, h * d + half + b)])
        writes = []
        proj = proj_norm(op)
        for h, p0, p1 in cls._spans(op, env.g, *tile.params["units"]):
            _, out, row = cls._head(op, h, nq, nkv)
            for s in range(seqs(op)):   # each row's (one at batch 1): sequence s // K's token s % K
                base = cls._q_at(op, s, row) if out == "q" else ((s // kt * nkv + row) * L + pos[s % kt]) * d
                for a, b in cls._rows(op, p0, p1):
                    if proj and out != "vcache":   # before the ticket: the units' pre-norm values
                        writes.append(Region.of(env.g, op.outputs["qk_part"], h * d + a, h * d + b))
                    else:
                        writes.append(Region.of(env.g, op.outputs[out], base + a, base + b))
        if proj:
            part = env.g.root(op.outputs["qk_part"])
            return [r for r in tile.reads if r.tensor != part], writes
        return tile.reads, writes



def _merge(regions: list[Region]) -> list[Region]:
    """Join adjacent regions of the same buffer."""
    out: list[Region] = []
    for r in regions:
        if out and out[-1].tensor == r.tensor and out[-1].stop == r.start:
            out[-1] = Region(r.tensor, out[-1].start, r.stop)
        else:
            out.append(r)
    return out
