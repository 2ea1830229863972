"""Split-KV decode attention (flash-decoding, Dao et al. 2023) with grouped-query attention.

``attention_partial``: one tile per (query-head group g, split c). A group is a KV head's GQA
group of query heads, or a part of it: a group of more than :data:`~.attention_rules.MAX_TILE_HEADS` query heads
(Falcon-7B's 71 over one KV head, StarCoder2-3B's 12) is cut into ``q_groups`` equal parts
(:func:`~.attention_rules.q_groups`), each its own tile group that reads the KV head's rows again (from L2), so that
no tile computes dozens of heads one after another while the other SMs idle. The valid rows
``[0, pos]`` are split evenly over the ``n_chunks`` tiles of a group at run time: tile c takes rows
``[c*(pos+1)//n_chunks, (c+1)*(pos+1)//n_chunks)`` (:func:`split_rows`), so every tile has work
once ``pos + 1 >= n_chunks`` whatever the position. For each query head of g's group it
computes the running max ``m``, the sum of exponentials ``l`` and the unnormalized output
``o = sum exp(s-m) v`` (fp32), and writes them to the partial buffers. An empty split writes
m = -inf, l = 0, o = 0. The scores of ``chunk`` rows (a block, at most the kernel knob
``FUSEC_ATTN_BLOCK_ROWS``, 512) fit shared memory; a split of more rows (a long cache: the
capacity's splits pass ``chunk``) runs over its blocks one by one with the online-softmax
rescaling of flash-decoding (:meth:`AttentionPartial._partial`):
per head the running ``m`` and ``l`` and, at each later block, ``o`` and ``l`` so far scaled by
``exp(m_old - m_new)`` before the block's terms are added.

Run-time lengths: the cache's rows L (and a mask's) may be a run-time length
(:attr:`fusec.ir.TensorInfo.sym`); the splits (``n_chunks``) and the block (``chunk``) are fixed
at compile time from the capacity, the rows of a split at run time, and the template takes L as
an argument (:meth:`fusec.cuda.codegen.Buffers.length`).
Over a capacity of more than 4096 rows an op may hold two tile sets of different cuts, the
position choosing one at run time (:mod:`fusec.instructions.attention_sets`).

``attention_reduce``: one tile per range of query heads merges the chunks with the
log-sum-exp rule: ``M = max m_c``, ``out = sum e^(m_c-M) o_c / sum e^(m_c-M) l_c``.

Active splits (kernel knob ``FUSEC_ATTN_SPLIT_ROWS`` = R > 0, default 32, :func:`active_splits`; lowering
records it as the op attr ``split_rows``, which the simulator and ``attention_reduce``'s call
read): at a position only the first ``active = min(n_chunks, max(1, ceil((pos+1) / R)))`` splits
of a group take rows, ``split_rows(c, pos, active)``: about R rows each (at most R while some
splits are idle, at least ``R // 2`` when two or more work), so that a short cache needs no
``n_chunks``-way merge; the block (``chunk``) grows to hold R rows (at most
:func:`~.attention_rules.max_block`, past it the block loop). A split ``c >= active`` reads its
position and nothing of K or V, writes no partial, and still takes its ticket (the last-tile
merge counts all ``n_chunks`` tickets as before: it runs once, in the step's last tile, whatever
``active`` is). The merges (the last tile's and ``attention_reduce``, which then also reads the
position) read the first ``active`` partials of each head only: the others hold an earlier
step's, or nothing. With a mask the rule counts the rows the mask splits, ``[0, L)`` (``pos``
is ``L - 1`` there, as everywhere in this kind, but for a mask proven bounded by the position,
attr ``mask_bound``: rows ``[0, pos]``). R = 0 (the default before 2026-12-04) keeps all ``n_chunks`` splits,
and the kernel's machine code of before the knob.

Last-tile merge (``attention_partial`` with an ``out`` output, option
``attention_merge="last_tile"``): no reduce op. Each tile, after its partial stores, takes an
atomic ticket of its group (a barrier, then one acquire-release ``atom.inc``); the tile that
takes the ``n_chunks``-th ticket of the step merges the group's chunks into ``out`` itself. One grid-wide
level less per layer. The tickets live in spare counters
(:meth:`fusec.cuda.codegen.Buffers.counters`), are zero at load and after a reset, and count
``0 .. n_chunks - 1`` in every step (``atomicInc`` wraps to 0 after the last), so "last" is
"took ``n_chunks - 1``" and no 32-bit overflow can shift it. Every tile declares the group's
``out`` region as a write, so a consumer waits for all of the group's tiles.

Shapes: q [Hq*D]; caches [1, Hkv, L, D]; o_part [Hq, C, D] fp32; ml_part [Hq, C, 2] fp32;
out [Hq*D] in the model dtype; optional mask [L] (attr ``mask_kind`` 1: bool, False rows get
-inf; 2: additive float, added to the scaled scores). With a mask every row of the cache,
``[0, L)``, is split over the tiles and the mask decides which count (as SDPA does), whatever
the position; a group whose every row is masked outputs 0 (SDPA's safe softmax). Source:
``torch.nn.functional.scaled_dot_product_attention`` with a causal decode mask
(``kv_index <= pos``), and the mask when the graph passes one that fusec cannot prove causal.

A batch of B <= 16 sequences of one query token each (docs/batch.md; attr ``batch`` B): HF's
StaticCache holds ``[B, Hkv, L, D]`` contiguous and the queries are ``[B, Hq, 1, D]``, so the
batch is one attention over B·Hkv KV heads and B·Hq query heads (``n_kv``, ``n_q``): query head
``b·Hq + h`` reads KV head ``b·Hkv + h // rep``, which is ``(b·Hq + h) // rep``; the output
``[B, Hq, 1, D]`` is flat the same way. The tiles, the splits (chosen for the B·groups), the
merges and ``attention_reduce`` are those of batch 1 over more heads. The KV write position is
shared by the sequences (HF's ``cumulative_length``). The one per-sequence difference is the
mask of left-padded prompts, ``[B, 1, 1, L]``: with attr ``mask_rows`` B, group ``gi`` reads
row ``gi // (groups / B)`` (the call passes the template that row's pointer); a mask of one row
serves every sequence. A batch-1 op has neither attr and renders as before.

A step of K = 2..8 query tokens per sequence (speculative decoding's verification step,
docs/batch.md "Several query tokens"; attr ``query_tokens`` K, B·K <= 16): the queries are
``[B, Hq, K, D]``, so query row ``i = (b·Hq + h)·K + k`` reads KV head ``i // (rep·K)``: the K rows
of a query head are K more query heads of its KV head's GQA group (``n_q`` = B·Hq·K, groups of
``rep·K`` rows, cut into ``q_groups`` parts of at most :data:`~.attention_rules.MAX_TILE_HEADS` as any group). The
causal order among the K new tokens and the cache comes from HF's mask ``[B, 1, K, L]`` (or one
``[1, 1, K, L]`` for every sequence; attr ``mask_rows`` B·K or K): row ``i`` reads mask row
``b·K + k`` (``k`` of a shared mask): the call passes a tile its sequence's first row (as at
K = 1) and the template (``QK`` = K) adds ``((g·REP + j) % K)·L`` for its row ``j``
(:func:`_query_mask_rows`). A mask is required: every cache row ``[0, L)`` is split and the mask
decides, as for a batch with a mask. HF transposes the output ``[B, Hq, K, D]`` to ``[B, K, Hq, D]``
for the o projection (``transpose(1, 2).contiguous()``: at K > 1 an ``aten.permute`` that copies,
a generic op on one SM, a dependency level of its own); the rule :func:`~.attention_rules.transposed_output` makes
it the merge's (the last tile's, or ``attention_reduce``'s): attr ``out_tokens``, the merged row
of query row ``(b·Hq + h)·K + k`` written at row ``(b·K + k)·Hq + h`` of the permute's output
(:func:`out_rows`; the templates' ``OHQ`` = Hq).
"""
from __future__ import annotations

import torch

from fusec.abi import Fault
from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.ir.semantics import TOKEN_POSITIONS, apply_mask, soft_cap, token_mask
from fusec.ir.pattern import sem
from fusec.instructions.base import COST_ROWS, CTA_THREADS, Instruction, Region, Tile, register, split_range
from fusec.instructions.call import P0, P1, SMEM, Call, Expr, Float, Int, Ptr, Type
from fusec.instructions.matvec_rows import MAX_SEQS, elt
from fusec.instructions.attention_rules import split_attention, takes_attention, transposed_output
from fusec.instructions.attention_rows import (_active_parts, _out_heads, _out_regions, _per_split,
                                               _query_mask_rows, _template_mask_kind, _write_rows, active_splits,
                                               merge_partials, reads_to_position, split_rows)
from fusec.instructions.attention_sets import SetsCall, chosen, has_sets, merged_tiles, set_tile, views
from fusec.instructions.rule import Rule


def _active_reduce(op: Op) -> bool:
    """``attention_reduce`` of active splits: it reads the position (and the cache's length)."""
    return _per_split(op) > 0


def _partial_of(op: Op, g: Graph) -> Op:
    """The ``attention_partial`` op whose partials ``attention_reduce`` ``op`` merges."""
    return next(o for o in g.ops if o.kind == "attention_partial" and o.outputs["o_part"] == op.inputs["o_part"])


def _merges(op: Op) -> bool:
    """Last-tile merge: the partial op writes the output itself."""
    return "out" in op.outputs


def _kv_head(op: Op, gi: int) -> int:
    """The KV head whose cache rows query-head group ``gi`` reads (in a batch, of the flat
    ``B * Hkv`` heads: sequence ``b``'s head ``h`` is ``b * Hkv + h``)."""
    return gi // op.attrs.get("q_groups", 1)


def _softcapped(op: Op) -> bool:
    """Whether ``op``'s scaled scores pass through Gemma-2's logit softcap (attr ``softcap``)."""
    return bool(op.attrs.get("softcap"))


def _mask_arg(op: Op, g: Graph, bufs) -> str:
    """The mask pointer a tile of ``op`` passes to the template: the mask, or at ``mask_rows``
    B > 1 its group's sequence row (``in.p0``, the group, over the groups per sequence, times
    the mask's run-time row length); ``nullptr`` without a mask. The template reads ``[0, L)``
    from it, so a batch-1 op's call is the one of before."""
    if "mask" not in op.inputs:
        return "nullptr"
    ptr = bufs.ptr(op.inputs["mask"])
    b, qk = op.attrs.get("batch", 1), op.attrs.get("query_tokens", 1)
    if b == 1 or op.attrs.get("mask_rows", 1) != b * qk:   # one mask (of K rows) for every sequence
        return ptr
    mask = op.inputs["mask"]
    per_seq = (op.attrs["n_kv"] * op.attrs.get("q_groups", 1)) // b
    length = bufs.length(mask, len(g.tensors[mask].shape) - 1)
    # at K > 1 the sequence's first of its K rows (the template adds its query row's token)
    return f"({ptr} + (size_t)(in.p0 / {per_seq}) * {length if qk == 1 else f'{qk} * {length}'})"


@register
class AttentionPartial(Instruction):
    name = "attention_partial"
    #: a batch of B sequences of K query tokens each, B·K up to MAX_SEQS (``takes_attention``)
    max_rows = MAX_SEQS
    #: every ``attention`` op that ``rms_qkv_rope`` left (it always splits; counts one fusion)
    rules = (Rule(sem("attention"), build=split_attention, check=takes_attention, priority=20),
             # a K-token step's output transposed for the o projection: the merge writes it so
             Rule(match=transposed_output, anchors=("aten.permute.default",), priority=21))

    @classmethod
    def _dims(cls, op: Op, g: Graph):
        """(n_q, groups, head_dim, chunk, n_chunks, L): ``groups`` the query-head groups
        (``n_kv * q_groups``; a group's tiles share one KV head, :func:`_kv_head`), L the cache's
        rows in the graph (the capacity of a run-time length; :meth:`_rows` at run time)."""
        a = op.attrs
        return a["n_q"], a["n_kv"] * a.get("q_groups", 1), a["head_dim"], a["chunk"], a["n_chunks"], \
            g.tensors[op.inputs["kcache"]].shape[2]

    @staticmethod
    def _rows(op: Op, env: Env) -> int:
        """The cache's rows at run time."""
        return env.length(op.inputs["kcache"], 2)

    @classmethod
    def multi_block(cls, op: Op, g: Graph) -> bool:
        """Whether a split may hold more rows than one block (``chunk``): then the template
        loops over blocks (MB), and keeps each head's running m, l and rescale factor in shared
        memory. With active splits one may hold up to ``split_rows`` rows."""
        nq, ng, d, chunk, nc, L = cls._dims(op, g)
        return max(-(-L // nc), _per_split(op)) > chunk

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        """One tile per (query-head group, split); an op of two tile sets (attention_sets):
        tile ``i`` of each."""
        if has_sets(op):
            return merged_tiles(op, *(cls._set_tiles(v, g) for v in views(op)))
        return cls._set_tiles(op, g)

    @staticmethod
    def _group_reads(op: Op, g: Graph, gi: int, rep: int, d: int) -> list[Region]:
        """What a tile of query-head group ``gi`` reads whatever the position: its queries, the
        position and the whole mask (a batch's tile: its rows, :meth:`runtime_regions`)."""
        reads = [Region.of(g, op.inputs["q"], gi * rep * d, (gi + 1) * rep * d), Region.whole(g, op.inputs["pos"])]
        return reads + ([Region.whole(g, op.inputs["mask"])] if "mask" in op.inputs else [])

    @classmethod
    def _set_tiles(cls, op: Op, g: Graph) -> list[Tile]:
        """The tiles of ``op``'s (one) tile set."""
        nq, ng, d, chunk, nc, L = cls._dims(op, g)
        rep = nq // ng
        tiles = []
        for gi in range(ng):
            for c in range(nc):
                # the rows depend on the run-time position: declare the whole head
                reads = cls._group_reads(op, g, gi, rep, d)
                kh = _kv_head(op, gi)
                for cache in ("kcache", "vcache"):
                    reads.append(Region.of(g, op.inputs[cache], kh * L * d, (kh + 1) * L * d))
                writes = cls._part_writes(op, g, gi, c, rep, d, nc)
                # at the longest position (at most COST_ROWS: a long capacity is not the usual length)
                kv = 2 * -(-min(L, COST_ROWS) // nc) * d * elt(g, op.inputs["kcache"])
                merge = 0
                if "out" in op.outputs:   # any tile of the group may be the one that merges it
                    reads += cls._group_parts(op, g, gi, rep, d, nc)
                    writes = writes + cls._group_out(op, g, gi, rep, d)
                    merge = rep * (nc * (d + 2) * 4 + d * elt(g, op.outputs["out"])) // nc
                tiles.append(Tile(op.name, len(tiles), {"group": gi, "chunk": c},
                                  reads, writes, 0, kv + rep * d * (2 + 4) + rep * 8 + merge))
        return tiles

    @classmethod
    def encode(cls, op: Op, tile: Tile) -> list[int]:
        p = tile.params
        return [p["group"], p["chunk"], p.get("long_group", 0), p.get("long_chunk", 0)]

    # two tile sets (attention_sets): both sets' calls, the position choosing
    call = SetsCall(lambda op: "attention_partial_merge" if _merges(op) else "attention_partial",
                targs=(Type("tq", "q"), Type("tc", "kcache"), Type("to", "out", when=_merges),
                       Int("NQ", lambda op, g: op.attrs["n_q"]),
                       # NKV: the query-head groups, KS of which share a KV head
                       Int("NKV", lambda op, g: AttentionPartial._dims(op, g)[1]),
                       Int("D", lambda op, g: op.attrs["head_dim"]),
                       Int("CH", lambda op, g: op.attrs["chunk"]), Int("NC", lambda op, g: op.attrs["n_chunks"]),
                       Int("KS", lambda op, g: op.attrs.get("q_groups", 1)),
                       Expr("MB", lambda op, g, bufs: "true" if AttentionPartial.multi_block(op, g) else "false"),
                       Int("MK", _template_mask_kind, default=0),
                       # (a placeholder without a mask where SC follows: template arguments are positional)
                       Type("tm", "mask", otherwise="bool", when=lambda op: "mask" in op.inputs or _softcapped(op)),
                       # K query tokens per sequence: each query row's own mask row
                       Int("QK", lambda op, g: op.attrs.get("query_tokens", 1), default=1),
                       # the merge's output transposed to [B, K, Hq, D] (out_tokens): Hq
                       Int("OHQ", lambda op, g: _out_heads(op), default=0, when=_merges),
                       # Gemma-2's logit softcap of the scaled scores (the argument softcap)
                       Int("SC", lambda op, g: int(_softcapped(op)), default=0)),
                args=(Ptr("q"), Ptr("kcache"), Ptr("vcache"), Ptr("pos"), Ptr("o_part"), Ptr("ml_part"),
                      Ptr("out", when=_merges),
                      Expr("tickets", lambda op, g, bufs: bufs.counters(op.name, AttentionPartial._dims(op, g)[1]),
                           when=_merges),
                      # the cache's rows: a literal, or the run-time length's slot
                      Expr("L", lambda op, g, bufs: bufs.length(op.inputs["kcache"], 2)),
                      Float("scale", "scale"), P0, P1, SMEM,
                      # a batch's mask (mask_rows): the group's sequence row (_mask_arg)
                      Expr("mask", _mask_arg, default="nullptr"),
                      Float("softcap", "softcap", fallback=0.0, default="0.0")),
                numbering=("q", "kcache", "vcache", "pos", "o_part", "ml_part", "mask", "out"))

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs) -> dict:
        if bufs.symbol(op.inputs["kcache"], 2) != bufs.symbol(op.inputs["vcache"], 2):
            raise NotImplementedError("attention_partial: K and V caches of different run-time lengths")
        short, *long = views(op)
        a = {**cls.call.values(short, g, bufs), "uses": ("attention_rows",)}   # the rows' helpers
        if long:   # the long set's values; the choice, as attention_sets.runs_long
            a["long"] = cls.call.values(long[0], g, bufs)
            a["long_when"] = (f"attention_long_set<{a.get('MK', 0)}, {a.get('QK', 1)}>({a['pos']}, {a['L']}, "
                              f"{op.attrs['long_set']['switch_rows']})")
        return a

    @classmethod
    def smem_floats(cls, op: Op, g: Graph) -> int:
        return max(cls._set_smem(v, g) for v in views(op))

    @classmethod
    def _set_smem(cls, op: Op, g: Graph) -> int:
        nq, ng, d, chunk, nc, L = cls._dims(op, g)
        rep = nq // ng
        esize = g.tensors[op.inputs["kcache"]].dtype.itemsize
        # the template's vector value path: rows of whole 16-byte chunks, at most a warp's 32 of them
        # (its lanes per row are the power of two at or above the chunks)
        vec = d % (16 // esize) == 0 and d // (16 // esize) <= 32
        # q [rep, d], scores [rep, chunk]; over several blocks each head's running m, l and
        # rescale factor [3, rep]; the vector value path adds per-warp partial outputs
        # [warps, min(rep, 4), d] (heads go in groups of at most 4)
        return rep * (d + chunk) + (3 * rep if cls.multi_block(op, g) else 0) + \
            ((CTA_THREADS // 32) * min(rep, 4) * d if vec else 0)

    @staticmethod
    def _group_parts(op, g, gi, rep, d, nc):
        """The partials of query-head group ``gi``'s heads, all chunks."""
        h0, h1 = gi * rep, (gi + 1) * rep
        return [Region.of(g, op.outputs["o_part"], h0 * nc * d, h1 * nc * d),
                Region.of(g, op.outputs["ml_part"], h0 * nc * 2, h1 * nc * 2)]

    @staticmethod
    def _group_out(op, g, gi, rep, d) -> list[Region]:
        """The output regions of query-head group ``gi`` (one; several with ``out_tokens``)."""
        return _out_regions(op, g, gi * rep, (gi + 1) * rep, d)

    @staticmethod
    def _part_writes(op, g, gi, c, rep, d, nc):
        w = []
        for h in range(gi * rep, (gi + 1) * rep):
            w.append(Region.of(g, op.outputs["o_part"], (h * nc + c) * d, (h * nc + c + 1) * d))
            w.append(Region.of(g, op.outputs["ml_part"], (h * nc + c) * 2, (h * nc + c + 1) * 2))
        return w

    @classmethod
    def _pos(cls, op: Op, env: Env) -> int:
        """The last cache row the tile group reads: the step's position, or L - 1 when a mask
        decides (the mask, not the position, says which rows count), or the last token's write
        position where the mask is the K write positions (``mask_kind`` 3) or is proven to
        attend no row past it (attr ``mask_bound``,
        :func:`fusec.ir.mask_proofs.bounded_by_positions`)."""
        if not reads_to_position(op):
            return cls._rows(op, env) - 1
        # the position, or the last token's
        pos, rows = int(env.read(op.inputs["pos"]).reshape(-1)[-1]), cls._rows(op, env)
        if not 0 <= pos < rows:   # the kernel's fault ATTN_POS: no access, the step is invalid
            from fusec.ir.aten_exec import index_fault
            raise index_fault(op, "attention position", pos, rows, Fault.ATTN_POS)
        return pos

    @classmethod
    def _pick(cls, op: Op, tile: Tile, env: Env) -> tuple[Op, Tile] | None:
        """(the view of the tile set the step runs, the tile as that set's), or None where the
        set has no tile of this index (:func:`~fusec.instructions.attention_sets.chosen`)."""
        if not has_sets(op):
            return op, tile
        c = chosen(op, tile, cls._pos(op, env))
        return None if c is None else (c[0], set_tile(c[0], tile, c[1], c[2]))

    @classmethod
    def runtime_regions(cls, op, tile, env):
        picked = cls._pick(op, tile, env)
        if picked is None:   # no tile of the step's set: it reads the position only
            return [Region.whole(env.g, op.inputs["pos"])], []
        op, tile = picked
        nq, ng, d, chunk, nc, _ = cls._dims(op, env.g)
        L = cls._rows(op, env)
        rep, gi = nq // ng, tile.params["group"]
        pos = cls._pos(op, env)
        active = active_splits(pos, nc, _per_split(op))
        reads = cls._group_reads(op, env.g, gi, rep, d)
        if "mask_rows" in op.attrs and op.attrs.get("mask_kind", 0) != TOKEN_POSITIONS:
            # the group's mask rows (its sequence's) at the run-time length
            rows = _query_mask_rows(op, gi)
            reads[2] = Region.of(env.g, op.inputs["mask"], min(rows) * L, (max(rows) + 1) * L)
        if tile.params["chunk"] >= active:   # no rows at this position: no partial either
            return reads, []
        r0, r1 = split_rows(tile.params["chunk"], pos, active)
        if r1 > r0:
            base = _kv_head(op, gi) * L * d
            reads += [Region.of(env.g, op.inputs[c], base + r0 * d, base + r1 * d) for c in ("kcache", "vcache")]
        return reads, cls._part_writes(op, env.g, gi, tile.params["chunk"], rep, d, nc)

    @classmethod
    def ticket_regions(cls, op, tile, env):
        """The merge, after the ticket: the group's partials and its output, if this tile's
        ticket is the group's last of the step."""
        picked = cls._pick(op, tile, env) if "out" in op.outputs else None
        if picked is None:
            return [], []
        op, tile = picked
        nq, ng, d, chunk, nc, L = cls._dims(op, env.g)
        rep, gi = nq // ng, tile.params["group"]
        if not cls._is_last(op, env, gi, nc, peek=True):
            return [], []
        active = active_splits(cls._pos(op, env), nc, _per_split(op))
        return _active_parts(op, env.g, gi * rep, (gi + 1) * rep, nc, d, active), \
            cls._group_out(op, env.g, gi, rep, d)

    @staticmethod
    def _is_last(op: Op, env: Env, gi: int, nc: int, peek: bool = False) -> bool:
        """Whether this tile's ticket of query-head group ``gi`` is the step's last (takes it unless ``peek``)."""
        key = (op.name, gi)
        t = env.peek_ticket(key) if peek else env.take_ticket(key)
        return t % nc == nc - 1

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        picked = cls._pick(op, tile, env)
        if picked is None:   # no tile of the step's set
            return
        op, tile = picked
        nq, ng, d, chunk, nc, L = cls._dims(op, env.g)
        rep = nq // ng
        gi = tile.params["group"]
        cls._partial(op, tile, env)
        if "out" in op.outputs and cls._is_last(op, env, gi, nc):
            hs = slice(gi * rep, (gi + 1) * rep)
            active = active_splits(cls._pos(op, env), nc, _per_split(op))   # the partials of this step
            o = env.read(op.outputs["o_part"]).reshape(nq, nc, d)[hs, :active]
            ml = env.read(op.outputs["ml_part"]).reshape(nq, nc, 2)[hs, :active]
            _write_rows(op, env, gi * rep, (gi + 1) * rep, merge_partials(o, ml))

    @classmethod
    def _partial(cls, op: Op, tile: Tile, env: Env) -> None:
        """The tile's split: its rows in blocks of ``chunk`` with the online-softmax rescaling,
        as the template (one block: m, l and o of its rows). A split past the active ones
        (:func:`active_splits`) writes nothing."""
        nq, ng, d, chunk, nc, _ = cls._dims(op, env.g)
        rep = nq // ng
        gi, c = tile.params["group"], tile.params["chunk"]
        pos = cls._pos(op, env)
        active = active_splits(pos, nc, _per_split(op))
        if c >= active:
            return
        r0, r1 = split_rows(c, pos, active)
        if r1 - r0 > chunk and not cls.multi_block(op, env.g):   # the template's scores would overflow
            raise RuntimeError(f"{op.name}: split {c} of {r1 - r0} rows passes the block of {chunk} in a "
                               f"kernel without the block loop (MB)")
        q = env.read(op.inputs["q"]).reshape(nq, d)[gi * rep:(gi + 1) * rep].float()
        o = env.flat(op.outputs["o_part"]).view(nq, nc, d)
        ml = env.flat(op.outputs["ml_part"]).view(nq, nc, 2)
        hs = slice(gi * rep, (gi + 1) * rep)
        if r1 <= r0:
            o[hs, c] = 0.0
            ml[hs, c, 0] = float("-inf")
            ml[hs, c, 1] = 0.0
            return
        rows = cls._rows(op, env)   # the caches' KV heads, flat over a batch's sequences
        kc, vc = (env.read(op.inputs[t]).reshape(-1, rows, d) for t in ("kcache", "vcache"))
        mask_all = None
        kind = op.attrs.get("mask_kind", 0)
        if kind == TOKEN_POSITIONS:   # each query row's token: rows 0 .. pos[token]
            mask_all = token_mask(env.read(op.inputs["mask"]), rows).reshape(-1, rows)[_query_mask_rows(op, gi)]
            kind = 1
        elif "mask" in op.inputs:   # each query row's row of the mask [rep, rows] (its sequence's, mask_rows)
            mask_all = env.read(op.inputs["mask"]).reshape(-1, rows)[_query_mask_rows(op, gi)]
        for b0 in range(r0, r1, chunk):
            b1 = min(b0 + chunk, r1)
            kh = _kv_head(op, gi)
            k, v = kc[kh, b0:b1].float(), vc[kh, b0:b1].float()
            s = soft_cap((q @ k.T) * op.attrs["scale"], op.attrs.get("softcap", 0.0))
            if mask_all is not None:   # each query row under its own mask row
                s = torch.stack([apply_mask(s[j], mask_all[j, b0:b1], kind)
                                 for j in range(s.shape[0])])
            mb = s.max(-1).values
            if b0 == r0:   # the first block (the only one of a split of at most chunk rows)
                m = mb
                p = torch.exp(s - m[:, None]).nan_to_num(0.0)   # a block masked whole: m = -inf, p = 0
                acc, l = p @ v, p.sum(-1)
                continue
            m_new = torch.maximum(m, mb)
            p = torch.exp(s - m_new[:, None]).nan_to_num(0.0)
            a = torch.exp(m - m_new).nan_to_num(0.0)          # the earlier blocks, rescaled (m = -inf: 0)
            acc = acc * a[:, None] + p @ v
            l = l * a + p.sum(-1)
            m = m_new
        o[hs, c] = acc
        ml[hs, c, 0] = m
        ml[hs, c, 1] = l


@register
class AttentionReduce(Instruction):
    name = "attention_reduce"

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs) -> dict:
        return {**super().cuda_args(op, g, bufs), "uses": ("attention_rows",)}   # active splits, positions

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        a = op.attrs
        nq, d, nc = a["n_q"], a["head_dim"], a["n_chunks"]
        tiles = []
        for i, (h0, h1) in enumerate(split_range(nq, want)):
            reads = [Region.of(g, op.inputs["o_part"], h0 * nc * d, h1 * nc * d),
                     Region.of(g, op.inputs["ml_part"], h0 * nc * 2, h1 * nc * 2)]
            if "pos" in op.inputs:   # active splits: the count comes from the position
                reads.append(Region.whole(g, op.inputs["pos"]))
            writes = _out_regions(op, g, h0, h1, d)
            tiles.append(Tile(op.name, i, {"heads": [h0, h1]}, reads, writes, 0,
                              (h1 - h0) * (nc * (d + 2) * 4 + d * elt(g, op.outputs["out"]))))
        return tiles

    # with active splits (split_rows): attention_reduce_active, which takes the position, the
    # mask kind and the cache's rows (L - 1 is the position with a mask)
    call = Call(lambda op: "attention_reduce_active" if _active_reduce(op) else "attention_reduce",
                targs=(Type("to", "out"), Int("D", lambda op, g: op.attrs["head_dim"]),
                       Int("NC", lambda op, g: op.attrs["n_chunks"]),
                       Int("MK", _template_mask_kind, when=_active_reduce),
                       Int("QK", lambda op, g: op.attrs.get("query_tokens", 1), default=1),
                       Int("OHQ", lambda op, g: _out_heads(op), default=0)),
                args=(Ptr("o_part"), Ptr("ml_part"), Ptr("pos", when=_active_reduce),
                      Expr("L", lambda op, g, bufs: bufs.length(_partial_of(op, g).inputs["kcache"], 2),
                           when=_active_reduce),
                      Ptr("out"), P0, P1))

    @classmethod
    def _active(cls, op: Op, env: Env) -> int:
        """The partials per head this step: all ``n_chunks``, or the active splits of the
        position (clamped to the cache's rows, as the template: a bad position has faulted in
        ``attention_partial`` already)."""
        nc = op.attrs["n_chunks"]
        if not _active_reduce(op):
            return nc
        part = _partial_of(op, env.g)
        rows = AttentionPartial._rows(part, env)
        pos = int(env.read(op.inputs["pos"]).reshape(-1)[-1]) if reads_to_position(part) else rows - 1
        return active_splits(min(max(pos, 0), rows - 1), nc, _per_split(op))

    @classmethod
    def runtime_regions(cls, op, tile, env):
        if not _active_reduce(op):
            return tile.reads, tile.writes
        a = op.attrs
        h0, h1 = tile.params["heads"]
        reads = _active_parts(op, env.g, h0, h1, a["n_chunks"], a["head_dim"], cls._active(op, env))
        return reads + [Region.whole(env.g, op.inputs["pos"])], tile.writes

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        a = op.attrs
        nq, d, nc = a["n_q"], a["head_dim"], a["n_chunks"]
        h0, h1 = tile.params["heads"]
        active = cls._active(op, env)
        o = env.read(op.inputs["o_part"]).reshape(nq, nc, d)[h0:h1, :active]
        ml = env.read(op.inputs["ml_part"]).reshape(nq, nc, 2)[h0:h1, :active]
        _write_rows(op, env, h0, h1, merge_partials(o, ml))
