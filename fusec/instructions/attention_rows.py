"""What the split-KV kinds (:mod:`fusec.instructions.attention`) share about a step's cache
rows and partials, on the simulator's side of templates/attention_rows.cu.j2: a split's rows
and the active splits of a position, the last row a tile reads, the log-sum-exp merge of
partials, and where merged query rows are written (a K-token step's output transposed)."""
from __future__ import annotations

import torch

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.ir.semantics import TOKEN_POSITIONS
from fusec.instructions.base import Region


def merge_partials(o: torch.Tensor, ml: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp merge of split-KV partials: o [H, C, D], ml [H, C, 2] (m, l) fp32 ->
    out [H, D] fp32. Empty chunks (m = -inf, l = 0) weigh 0."""
    m, l = ml[..., 0], ml[..., 1]
    big = m.max(-1, keepdim=True).values
    wgt = torch.exp(m - big).nan_to_num(0.0)      # empty chunks: exp(-inf) = 0
    den = (wgt * l).sum(-1, keepdim=True)
    out = (wgt[..., None] * o).sum(1) / den
    return torch.where(den > 0, out, torch.zeros_like(out))   # every row masked: 0, as SDPA


def split_rows(c: int, pos: int, n_chunks: int) -> tuple[int, int]:
    """Rows ``[r0, r1)`` of split ``c`` of the valid cache rows ``[0, pos]`` (even split,
    the same integer arithmetic as the CUDA template). With active splits ``n_chunks`` is the
    active count (:func:`active_splits`), for ``c`` below it."""
    n = pos + 1
    return c * n // n_chunks, (c + 1) * n // n_chunks


def active_splits(pos: int, n_chunks: int, per_split: int = 0) -> int:
    """How many of a group's ``n_chunks`` splits take rows at position ``pos`` (the first ones):
    all of them with ``per_split`` 0 (knob ``FUSEC_ATTN_SPLIT_ROWS`` off), else
    ``min(n_chunks, max(1, ceil((pos + 1) / per_split)))``: an active split holds at most
    ``per_split`` rows unless all ``n_chunks`` are active, and at least ``per_split // 2`` when
    two or more are (the template's ``attention_active_splits``)."""
    if per_split <= 0:
        return n_chunks
    return min(n_chunks, max(1, (pos + per_split) // per_split))


def _per_split(op: Op) -> int:
    """The op's ``FUSEC_ATTN_SPLIT_ROWS`` as lowered (0: every split takes rows)."""
    return op.attrs.get("split_rows", 0)


def reads_to_position(op: Op) -> bool:
    """Whether a split-KV op's tiles read the cache rows up to the last element of its ``pos``
    input (no mask; the K write positions as the mask, ``mask_kind`` 3; a mask proven to attend
    no row past them, attr ``mask_bound``) rather than all ``L`` rows, where a mask decides
    (templates/attention_rows.cu.j2 ``attention_last_row``)."""
    return "mask" not in op.inputs or op.attrs.get("mask_kind", 0) == TOKEN_POSITIONS \
        or bool(op.attrs.get("mask_bound"))


def _template_mask_kind(op: Op, g: Graph) -> int:
    """The templates' MK: the op's ``mask_kind``, or 4 for a bool mask (kind 1) that attends no
    row past the last write position (attr ``mask_bound``): read as kind 1, over rows up to
    that position only (templates/attention_rows.cu.j2)."""
    kind = op.attrs.get("mask_kind", 0)
    return 4 if kind == 1 and op.attrs.get("mask_bound") else kind


def _active_parts(op: Op, g: Graph, h0: int, h1: int, nc: int, d: int, active: int,
                  o_slot: str = "o_part", ml_slot: str = "ml_part") -> list[Region]:
    """The first ``active`` partials of query heads ``[h0, h1)`` (all ``nc``: two regions)."""
    slots = {**op.inputs, **op.outputs}
    if active >= nc:
        return [Region.of(g, slots[o_slot], h0 * nc * d, h1 * nc * d),
                Region.of(g, slots[ml_slot], h0 * nc * 2, h1 * nc * 2)]
    out = []
    for h in range(h0, h1):
        out += [Region.of(g, slots[o_slot], h * nc * d, (h * nc + active) * d),
                Region.of(g, slots[ml_slot], h * nc * 2, (h * nc + active) * 2)]
    return out


def out_rows(op: Op, h0: int, h1: int) -> list[int]:
    """The output rows (of D elements) that the merged query rows ``[h0, h1)`` of ``op`` (an
    ``attention_partial`` or ``attention_reduce``) are written at: the same rows, or with attr
    ``out_tokens`` (a K-token step's output transposed to ``[B, K, Hq, D]``, :func:`~.attention_rules.transposed_output`)
    query row ``(b·Hq + h)·K + k`` at ``(b·K + k)·Hq + h`` (the template's ``attention_out_row``)."""
    if not op.attrs.get("out_tokens"):
        return list(range(h0, h1))
    k = op.attrs["query_tokens"]
    hq = op.attrs["n_q"] // (op.attrs.get("batch", 1) * k)
    return [((i // (hq * k)) * k + i % k) * hq + (i // k) % hq for i in range(h0, h1)]


def _out_regions(op: Op, g: Graph, h0: int, h1: int, d: int) -> list[Region]:
    """The regions of ``op``'s output that its merged query rows ``[h0, h1)`` are written to
    (:func:`out_rows`; consecutive rows as one region)."""
    runs: list[list[int]] = []
    for r in out_rows(op, h0, h1):
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    return [Region.of(g, op.outputs["out"], a * d, b * d) for a, b in runs]


def _write_rows(op: Op, env: Env, h0: int, h1: int, rows: torch.Tensor) -> None:
    """Write the merged query rows ``[h0, h1)`` (``rows`` [h1 - h0, D]) of ``op`` at their output rows."""
    dt = env.g.tensors[op.outputs["out"]].dtype
    out = env.flat(op.outputs["out"]).view(-1, rows.shape[-1])
    if op.attrs.get("out_tokens"):
        out[out_rows(op, h0, h1)] = rows.to(dt)
    else:
        out[h0:h1] = rows.to(dt)


def _out_heads(op: Op) -> int:
    """The templates' OHQ: Hq where the output is written transposed (``out_tokens``), else 0."""
    if not op.attrs.get("out_tokens"):
        return 0
    return op.attrs["n_q"] // (op.attrs.get("batch", 1) * op.attrs["query_tokens"])


def _query_mask_rows(op: Op, gi: int) -> list[int]:
    """The mask row each query row of query-head group ``gi`` reads, in order (the group's
    ``n_q / groups`` rows). Row ``i`` (flat over the batch's ``[B, Hq, K, D]`` queries) is
    sequence ``b = i // (n_q / B)``'s token ``k = i % K``; it reads mask row ``b·K + k`` where the
    mask has ``B·K`` rows (attr ``mask_rows``: its sequence's rows), else ``k`` (one set of K
    rows for every sequence; at K = 1: row 0, or the sequence's row of a ``[B, 1, 1, L]`` mask)."""
    a = op.attrs
    b, qk, rows = a.get("batch", 1), a.get("query_tokens", 1), a.get("mask_rows", 1)
    per_group = a["n_q"] // (a["n_kv"] * a.get("q_groups", 1))
    per_seq = a["n_q"] // b
    return [(i // per_seq if rows == b * qk else 0) * qk + i % qk
            for i in range(gi * per_group, (gi + 1) * per_group)]
