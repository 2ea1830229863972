"""The rules that make split-KV attention (:mod:`fusec.instructions.attention`'s kinds) from
the graph: which ``attention`` ops the kinds take (:func:`takes_attention`: B sequences of K
query tokens, their masks), how each splits into ``attention_partial`` tiles and an optional
``attention_reduce`` (:func:`split_attention`: splits per query-head group, the block, the
attrs the kinds read), and the permute of a K-token step's output that the merge writes
transposed (:func:`transposed_output`). The kinds' module docstring gives the method."""
from __future__ import annotations

import math

import torch

from fusec.cuda.knobs import KNOBS
from fusec.ir import Graph, Op
from fusec.ir.semantics import TOKEN_POSITIONS
from fusec.instructions.matvec_rows import MAX_SEQS
from fusec.instructions.rule import Ctx, Fusion


def max_block(options: dict) -> int:
    """The most rows of scores a split-KV tile keeps in shared memory (one block; a split of more
    rows runs over several, each a dependent round of scores, softmax and values): the kernel
    knob ``FUSEC_ATTN_BLOCK_ROWS`` among the ``defines`` option, else its default, rounded down
    to a multiple of 16 and at least 16. A block of ``rows`` takes ``heads * rows * 4`` bytes of
    shared memory (at most :data:`MAX_TILE_HEADS` heads: 16 KiB at 512 rows)."""
    rows = int(options.get("defines", {}).get("FUSEC_ATTN_BLOCK_ROWS", KNOBS["FUSEC_ATTN_BLOCK_ROWS"]))
    return max(16, rows // 16 * 16)

#: the most query heads one split-KV tile computes: its scores and value accumulators per head are
#: registers and shared memory, and its heads run one after another (a tile of Falcon-7B's 71 heads
#: took 35 µs and its merge 48 µs on the H200, docs/performance.md)
MAX_TILE_HEADS = 8


def tile_heads(options: dict) -> int:
    """The most query heads one split-KV tile computes: the kernel knob ``FUSEC_ATTN_TILE_HEADS``
    among the ``defines`` option, else its default; 0 (the default): :func:`auto_q_groups` picks
    the cut (1 to :data:`MAX_TILE_HEADS` otherwise: the knob's range, which
    :class:`fusec.config.Options` checks)."""
    return int(options.get("defines", {}).get("FUSEC_ATTN_TILE_HEADS", KNOBS["FUSEC_ATTN_TILE_HEADS"]))


def q_groups(rep: int, max_heads: int = MAX_TILE_HEADS) -> int:
    """The parts a GQA group of ``rep`` query heads is cut into: the fewest, ``k``, that divide
    ``rep`` with at most ``max_heads`` (:data:`MAX_TILE_HEADS` unless given) heads each (1 for
    ``rep <= 8``; 12 -> 2 of 6, 71 -> 71 of 1). Equal parts keep the template's heads per tile a
    constant."""
    return next(k for k in range(1, rep + 1) if rep % k == 0 and rep // k <= max_heads)


#: :func:`auto_q_groups` cuts a group while its merge would combine more partials than this
MERGE_PARTS = 16
#: ... and while a tile's K and V rows at the cache's capacity stay within this many bytes
TILE_KV_BYTES = 128 * 1024
#: ... the capacity taken as at most this many rows: a length-polymorphic step (HF generate(),
#: fusec.generate, a plain loop's second cache length) is built for 32768 rows, and its tiles
#: share the valid rows at run time (``attention.split_rows``), so below this position a cut
#: tile reads what it reads in a step of this capacity
REFERENCE_ROWS = 4096


#: :func:`long_set` switches to the long tile set where a short-set tile would read more than this
#: many bytes of K and V per query head a long-set tile has for each of the short one's
SWITCH_BYTES_PER_HEAD = 32 * 1024


def splits(rows: int, groups: int, num_sms: int) -> int:
    """The split-KV splits per tile group before blocking (:func:`split_attention`): one per 16
    cache rows, at most the SMs each of ``groups`` tile groups gets."""
    return max(1, min(math.ceil(rows / 16), num_sms // groups))


def auto_q_groups(rep: int, n_kv: int, rows: int, head_dim: int, itemsize: int, num_sms: int) -> int:
    """The parts a GQA group of ``rep`` query heads is cut into when the knob
    ``FUSEC_ATTN_TILE_HEADS`` is 0 (its default): of the cuts :func:`q_groups` allows (equal
    parts of at most :data:`MAX_TILE_HEADS` heads), the fewest whose merge combines at most
    :data:`MERGE_PARTS` partials per tile group, among those whose tile reads at most
    :data:`TILE_KV_BYTES` of K and V at the cache's capacity (at most :data:`REFERENCE_ROWS`
    rows); where none has so few partials, the most parts within those bytes; where no cut is
    within them, the fewest parts.

    Args:
        rep: query heads (times query tokens) per KV head; ``n_kv``: KV heads (times sequences);
        rows: the cache's rows (its capacity; more than :data:`REFERENCE_ROWS` count as that
        many); ``head_dim``, ``itemsize``: the cache's head size and bytes per element;
        ``num_sms``: the SMs the step runs on.

    Why (docs/performance.md, H100, full depth, cache 4096): with few KV heads a group's splits
    are many and short, and its last tile merges them all (Qwen2.5-0.5B, 2 KV heads of 7 query
    heads: 66 splits of 7 heads; cut to 14 groups of one head: 9 splits, the step 0.17 ms
    shorter at positions 100 and 3000); cut further than 16 partials, each group reads its KV
    head's rows again, and a tile's K and V grow with the cut (Qwen3-0.6B cut to 16 groups of
    128-wide heads: 256 KiB a tile, 8% slower at 3000). A length-polymorphic step (capacity
    32768, its splits sharing the valid rows at run time) is cut as a 4096-row step: Qwen2.5-0.5B
    10-16% faster at positions 100-3000, 14% slower at 16000 (H100, 2026-12-07); past the cut's
    tile bytes such a step runs a second tile set, the capacity's cut (:func:`long_set`)."""
    return _cut(rep, n_kv, min(rows, REFERENCE_ROWS), head_dim, itemsize, num_sms)


def _cut(rep: int, n_kv: int, rows: int, head_dim: int, itemsize: int, num_sms: int) -> int:
    """:func:`auto_q_groups`'s choice at exactly ``rows`` rows (no :data:`REFERENCE_ROWS` bound)."""
    ks = [k for k in range(q_groups(rep), rep + 1) if rep % k == 0 and rep // k <= MAX_TILE_HEADS]

    def tile_bytes(k: int) -> int:
        return math.ceil(rows / splits(rows, n_kv * k, num_sms)) * head_dim * 2 * itemsize

    within = [k for k in ks if tile_bytes(k) <= TILE_KV_BYTES]
    few = [k for k in within if splits(rows, n_kv * k, num_sms) <= MERGE_PARTS]
    return few[0] if few else within[-1] if within else ks[0]


def _blocks(L: int, groups: int, options: dict) -> tuple[int, int]:
    """(``n_chunks``, ``chunk``) of a tile set of ``groups`` query-head groups over a cache of
    ``L`` rows (:func:`split_attention`): :func:`splits` splits of a multiple of 16 rows; where
    that is at most :func:`max_block`, as few splits as hold L, else splits of several blocks;
    with ``FUSEC_ATTN_SPLIT_ROWS`` = R > 0 among the ``defines`` the block grows to hold R rows."""
    n_chunks = splits(L, groups, options["num_sms"])
    chunk = math.ceil(math.ceil(L / n_chunks) / 16) * 16
    block = max_block(options)
    if chunk <= block:   # a split is one block: as few splits as hold L
        n_chunks = math.ceil(L / chunk)
    else:                # splits of several blocks
        chunk = block
    per_split = int(options.get("defines", {}).get("FUSEC_ATTN_SPLIT_ROWS", KNOBS["FUSEC_ATTN_SPLIT_ROWS"]))
    if per_split > 0:   # an idle split leaves up to per_split rows to each active one: one block
        chunk = max(chunk, min(block, math.ceil(per_split / 16) * 16))
    return n_chunks, chunk


def long_set(options: dict, rep: int, n_kv: int, rows: int, head_dim: int, itemsize: int, cut: int,
             n_chunks: int) -> dict | None:
    """The second tile set of a split-KV op over a capacity of more than :data:`REFERENCE_ROWS`
    rows, or None: the cut :func:`auto_q_groups` makes at the capacity itself, where it differs
    from ``cut`` (the one made at :data:`REFERENCE_ROWS`, ``n_chunks`` splits), and the step reads
    more rows than ``switch_rows``, the most at which a tile of ``cut`` reads at most
    :data:`SWITCH_BYTES_PER_HEAD` of K and V times ``cut / wide`` (a long-set tile's query heads
    per head of a short-set tile: 7 for Qwen2.5-0.5B, 3 for SmolLM2-360M). Only for the
    default cut (``FUSEC_ATTN_TILE_HEADS`` 0), the last-tile merge and the kernel knob
    ``FUSEC_ATTN_LONG_SET`` at 1 (its default).

    Returns:
        ``{"q_groups", "n_chunks", "chunk", "switch_rows"}``: the attrs of the set
        (:mod:`fusec.instructions.attention_sets` runs it where the step reads more than
        ``switch_rows`` rows).

    Why (H100, full depth, capacity 32768, 2026-12-07, docs/performance.md "Two tile sets"): cut
    to one head a tile, Qwen2.5-0.5B (7 heads a long-set tile) is faster than uncut up to about
    8000 rows and SmolLM2-360M (3) up to about 3000: where a short-set tile reads about 222 and
    90 KB, 32 KiB per head of a long-set tile (two models, both with one head a short-set tile:
    a fit, not a model of the tiles' time; the 128 KiB of :data:`TILE_KV_BYTES` switched Qwen2.5
    3.9% too early at 6000 and SmolLM2 1% too late)."""
    on = int(options.get("defines", {}).get("FUSEC_ATTN_LONG_SET", KNOBS["FUSEC_ATTN_LONG_SET"]))
    if not on or tile_heads(options) or options["attention_merge"] != "last_tile" or rows <= REFERENCE_ROWS:
        return None
    wide = _cut(rep, n_kv, rows, head_dim, itemsize, options["num_sms"])
    # a long-set tile's heads per head of a short-set tile (each divides rep)
    switch = SWITCH_BYTES_PER_HEAD * (cut // wide) // (head_dim * 2 * itemsize) * n_chunks
    if wide == cut or switch >= rows:
        return None
    nc, chunk = _blocks(rows, n_kv * wide, options)
    return {"q_groups": wide, "n_chunks": nc, "chunk": chunk, "switch_rows": switch}


def _seqs(g: Graph, att: Op) -> int:
    """The sequences B of ``att``'s caches ``[B, Hkv, L, D]`` (dim 0)."""
    return int(g.tensors[g.root(att.inputs["k"])].shape[0])


def _mask_rows(g: Graph, att: Op) -> int:
    """The rows of ``att``'s mask over its ``L`` cache rows in a step of K query tokens per
    sequence (:meth:`fusec.ir.Graph.query_tokens`): 0 without a mask, K for one row per query
    token that serves every sequence (K = 1: one row; also the K write positions of ``mask_kind``
    :data:`~fusec.ir.semantics.TOKEN_POSITIONS`), B·K for K rows per sequence (``[B, 1, K, L]``:
    HF's mask of a K-token step, of left-padded prompts at K = 1), -1 for any other layout."""
    if "mask" not in att.inputs:
        return 0
    L = g.tensors[g.root(att.inputs["k"])].shape[2]
    n, b, k = g.tensors[att.inputs["mask"]].numel, _seqs(g, att), g.query_tokens()
    if att.attrs.get("mask_kind", 0) == TOKEN_POSITIONS:   # the K write positions, shared by the sequences
        return k if k > 1 and n == k else -1
    if k > 1 and g.tensors[att.inputs["mask"]].shape[-1] != L:
        return -1
    return k if n == k * L else (b * k if n == b * k * L else -1)


def takes_attention(g: Graph, m: dict) -> bool:
    """The rule's check: B sequences of K query tokens each (:meth:`fusec.ir.Graph.query_tokens`),
    B·K at most :data:`MAX_SEQS`, over caches ``[B, Hkv, L, D]`` whose queries are ``[B, Hq, K,
    D]`` (any layout of Hq·D elements at batch 1 with one token). One query token: no mask, one
    mask row for every sequence, or one per sequence. K > 1: a mask (bool or additive, ``[B, 1,
    K, L]`` or one ``[1, 1, K, L]`` for every sequence) over the cache's rows, which makes the K
    rows causal, or the K write positions (``mask_kind`` 3: token k attends rows ``<= pos[k]``).
    At B > 1 the batch is an attention over B·Hkv KV heads and B·Hq query heads
    (query head ``b·Hq + h`` reads KV head ``b·Hkv + h // rep``: the flat layouts of q, the caches
    and the output), each sequence's groups reading its mask rows; at K > 1 each of a head's K
    query rows is a query head of its own (module docstring)."""
    att = m["_anchor"]
    b, k = _seqs(g, att), g.query_tokens()
    q = g.tensors[att.inputs["q"]]
    if b * k > MAX_SEQS or _mask_rows(g, att) < 0:
        return False
    if k > 1:
        return len(q.shape) == 4 and q.shape[0] == b and q.shape[2] == k and _mask_rows(g, att) > 0 \
            and att.attrs.get("mask_kind", 0) in (1, 2, TOKEN_POSITIONS)
    if b == 1:
        return True
    return len(q.shape) == 4 and q.shape[0] == b and q.shape[2] == 1


def split_attention(c: Ctx, m: dict) -> list[Op]:
    """``attention`` -> ``attention_partial`` (about ``min(ceil(L/16), num_sms // groups)`` splits
    per query-head group, ``groups = B * Hkv * q_groups(K * Hq / Hkv)`` for B sequences of K
    query tokens; a batch (B > 1) gets the attrs ``batch`` B and, with a mask of one row per
    sequence, ``mask_rows`` B: group ``gi`` reads mask row ``gi // (groups / B)``; a step of K > 1
    query tokens the attrs ``query_tokens`` K and ``mask_rows`` K or B·K, :func:`_query_mask_rows`),
    blocks of a multiple of 16 rows, at most :func:`max_block`; L the cache's rows, its capacity
    for a run-time length) whose last tile per group merges (``attention_merge="last_tile"``),
    or ``attention_partial`` + ``attention_reduce`` (``"reduce"``). A non-zero
    ``FUSEC_ATTN_SPLIT_ROWS`` among the ``defines`` becomes the attr ``split_rows`` of both (and
    the reduce's input ``pos``), and the block grows to hold it (a multiple of 16, at most
    :func:`max_block`): an active split holds up to that many rows while others idle. Over more
    than :data:`REFERENCE_ROWS` rows, at one query token per sequence, the last-tile merge's op
    may carry a second tile set for the positions past its switch (:func:`long_set`;
    attr ``long_set``, outputs ``o_part_long``, ``ml_part_long``:
    :mod:`fusec.instructions.attention_sets`)."""
    g, att = c.g, m["_anchor"]
    kc = g.tensors[g.root(att.inputs["k"])]
    b, hkv, L, d = kc.shape
    nkv = b * hkv   # a batch of B sequences: B * Hkv KV heads (the cache's flat layout)
    nq = g.tensors[att.inputs["q"]].numel // d
    th = tile_heads(c.options)
    hs = (q_groups(nq // nkv, th) if th else
          auto_q_groups(nq // nkv, nkv, L, d, kc.dtype.itemsize, c.options["num_sms"]))
    n_chunks, chunk = _blocks(L, nkv * hs, c.options)
    per_split = int(c.options.get("defines", {}).get("FUSEC_ATTN_SPLIT_ROWS", KNOBS["FUSEC_ATTN_SPLIT_ROWS"]))
    o_part = g.new_tensor(f"{att.name}_o_part", (nq, n_chunks, d), torch.float32)
    ml_part = g.new_tensor(f"{att.name}_ml_part", (nq, n_chunks, 2), torch.float32)
    # one query token per sequence only: with both sets a K-token step's fusec_step spilled (8 B at
    # K = 2 on Qwen2.5-0.5B's shape, NVRTC sm_90a)
    long = long_set(c.options, nq // nkv, nkv, L, d, kc.dtype.itemsize, hs, n_chunks) if g.query_tokens() == 1 else None
    attrs = {"scale": att.attrs["scale"], "n_q": nq, "n_kv": nkv, "head_dim": d,
             "chunk": chunk, "n_chunks": n_chunks, "mask_kind": att.attrs.get("mask_kind", 0)}
    if att.attrs.get("mask_bound"):   # only then: the graph (and its dump) as before the attr
        attrs["mask_bound"] = True
    if att.attrs.get("softcap"):      # likewise (Gemma-2's eager attention)
        attrs["softcap"] = att.attrs["softcap"]
    if per_split > 0:   # only then: the default graph (and its dump) as before the knob
        attrs["split_rows"] = per_split
    if hs > 1:          # likewise: a group of at most MAX_TILE_HEADS query heads is one tile group
        attrs["q_groups"] = hs
    if b > 1:           # likewise: a batch-1 op has neither
        attrs["batch"] = b
        if _mask_rows(g, att) == b:
            attrs["mask_rows"] = b
    if g.query_tokens() > 1:   # K query rows per head: the mask's rows (K, or K per sequence)
        attrs["query_tokens"] = g.query_tokens()
        attrs["mask_rows"] = _mask_rows(g, att)
    ins = {"q": att.inputs["q"], "kcache": att.inputs["k"], "vcache": att.inputs["v"],
           "pos": att.inputs["pos"]}
    if "mask" in att.inputs:
        ins["mask"] = att.inputs["mask"]
    part = Op(g.fresh_name(f"{att.name}_partial"), "attention_partial", ins,
              {"o_part": o_part, "ml_part": ml_part}, attrs=attrs, source=att.source)
    if c.options["attention_merge"] == "last_tile":
        part.outputs["out"] = att.outputs["out"]
        if long:   # the second tile set (attention_sets): its partials of its own
            part.attrs["long_set"] = long
            part.outputs["o_part_long"] = g.new_tensor(f"{att.name}_o_part_long", (nq, long["n_chunks"], d),
                                                       torch.float32)
            part.outputs["ml_part_long"] = g.new_tensor(f"{att.name}_ml_part_long", (nq, long["n_chunks"], 2),
                                                        torch.float32)
        return [part]
    red = Op(g.fresh_name(f"{att.name}_reduce"), "attention_reduce",
             {"o_part": o_part, "ml_part": ml_part}, {"out": att.outputs["out"]},
             attrs=dict(attrs), source=att.source)
    if per_split > 0:   # the active splits come from the position
        red.inputs["pos"] = att.inputs["pos"]
    return [part, red]


def transposed_output(c: Ctx, anchor: Op) -> Fusion | None:
    """The rule's match: an ``aten.permute`` with dims ``[0, 2, 1, 3]`` of the whole output
    ``[B, Hq, K, D]`` of a K-token step's attention (K > 1: the ``attention_partial`` that merges
    in its last tile, or the ``attention_reduce``), read by nothing else, becomes that op's
    output written transposed (attr ``out_tokens``: :func:`out_rows`); the permute goes (one
    generic op on one SM and its level less per layer). None where it does not apply."""
    g = c.g
    args = anchor.attrs.get("args") or ()
    if set(anchor.inputs) != {"in0"} or len(args) != 2 or list(args[1]) != [0, 2, 1, 3] or "out" not in anchor.outputs:
        return None
    p = c.prod(anchor.inputs["in0"], ("attention_partial", "attention_reduce"))
    if p is None or p.attrs.get("query_tokens", 1) == 1 or p.attrs.get("out_tokens") or "out" not in p.outputs:
        return None
    made, x, out = (g.tensors[t] for t in (p.outputs["out"], anchor.inputs["in0"], anchor.outputs["out"]))
    if g.root(anchor.inputs["in0"]) != g.root(p.outputs["out"]) or tuple(x.shape) != tuple(made.shape) or \
            len(x.shape) != 4 or x.shape[2] != p.attrs["query_tokens"] or out.numel != made.numel or out.dtype != made.dtype or \
            out.alias_of is not None or made.alias_of is not None or out.sym or made.sym:
        return None

    def build() -> list[Op]:
        return [Op(p.name, p.kind, dict(p.inputs), {**p.outputs, "out": anchor.outputs["out"]},
                   dict(p.attrs, out_tokens=True), p.mutates, p.source, p.layer)]
    keep = tuple(t for s, t in p.outputs.items() if s != "out") + (anchor.outputs["out"],)
    return Fusion([p, anchor], keep, build, place="first")
