"""kv_roll: a KV cache's rows rolled left in place, over many SMs.

Source: HF's ``StaticSlidingWindowLayer`` once its window of ``n`` rows is full rolls the cache
left by one row each decode step (``roll(-1)``, then the new row at ``n - 1`` and a ``copy_``
back: ``recognize`` makes that ``kv_roll`` + ``kv_write``), so the cache holds HF's layout after
every step (eager steps, a fallback and HF's next roll read it). Semantics: in each of the
``A = shape[0] * shape[1]`` heads, rows ``[0, n - k)`` take rows ``[k, n)`` (``k``: attr
``shift``); rows ``[n - k, n)`` keep their values (the ``kv_write`` after it overwrites them).

Tiles: each head's ``n - k`` destination rows are split into ``pieces`` ranges (attr, chosen by
the fusion rule from the SM count; one piece per head without it), one tile per (head, piece).
A tile reads the rows it moves from its own range, except the ``k`` rows past its end, which
the next piece overwrites: those come from ``halo`` ([heads, (pieces - 1) * k rows], an
``index_select`` of the cache that the rule puts before the op, so the scheduler orders every
piece's writes after it). In place within a tile: it moves its rows in ascending chunks, each
loaded whole before it is stored (a row is read before the chunk that overwrites it).
Bytes: each row once read and once written (the halo's few rows twice).
"""
from __future__ import annotations

import torch

from fusec.ir.env import Env
from fusec.ir import Graph, Op, Ref, Role
from fusec.instructions.base import Instruction, Region, Tile, register, split_range
from fusec.instructions.call import P0, P1, P2, Call, Int, Ptr, Type
from fusec.instructions.rule import Ctx, Fusion, Rule

#: a piece moves at least this many bytes: the rolls run first in the step (``recognize``), off
#: the layers' path, so fewer and larger tiles (each costs about 2 us to dispatch and wait) beat
#: more SMs: Gemma-3-1B's 256 KiB K cache of a sliding layer in 8 pieces, Mistral-7B's 8 MiB in
#: 16 per head (128 tiles)
MIN_PIECE_BYTES = 32768


def _layout(op: Op, g: Graph) -> tuple[int, int, int, int]:
    """(heads A, rows n, row elements D, shift k) of the rolled cache."""
    shape = g.tensors[op.outputs["cache"]].shape
    return shape[0] * shape[1], shape[2], shape[3], int(op.attrs.get("shift", 1))


def pieces(op: Op, g: Graph, num_sms: int) -> list[tuple[int, int]]:
    """The destination row ranges of one head's pieces: about ``num_sms`` tiles over all heads,
    each moving at least :data:`MIN_PIECE_BYTES` and at least ``k`` rows."""
    a, n, d, k = _layout(op, g)
    row_bytes = d * g.tensors[op.outputs["cache"]].dtype.itemsize
    min_rows = max(k, -(-MIN_PIECE_BYTES // row_bytes))
    return split_range(n - k, max(1, min(num_sms // a, (n - k) // min_rows)))


def _halo_rows(ranges: list[tuple[int, int]], k: int) -> list[int]:
    """The rows each piece but the last reads past its end, piece by piece: the halo's rows."""
    return [e + r for _, e in ranges[:-1] for r in range(k)]


def _split(c: Ctx, roll: Op) -> Fusion | None:
    """A ``kv_roll`` without a halo -> the ``index_select`` of its halo rows + the ``kv_roll``
    in ``pieces`` pieces per head reading it (module docstring), when there is more than one."""
    g = c.g
    if "halo" in roll.inputs:
        return None
    ranges = pieces(roll, g, c.options.get("num_sms", 132))
    if len(ranges) < 2:
        return None
    _, _, d, k = _layout(roll, g)
    cache = roll.outputs["cache"]
    shape = g.tensors[cache].shape
    rows = _halo_rows(ranges, k)

    def build() -> list[Op]:
        idx = g.new_tensor(f"{roll.name}_halo_rows", (len(rows),), torch.int64, Role.CONSTANT,
                           value=torch.tensor(rows, dtype=torch.int64))
        halo = g.new_tensor(f"{roll.name}_halo", (shape[0], shape[1], len(rows), d), g.tensors[cache].dtype)
        save = Op(g.fresh_name(f"{roll.name}_save"), "aten.index_select.default", {"in0": roll.inputs["src"], "in1": idx},
                  {"out": halo}, attrs={"target": torch.ops.aten.index_select.default,
                                        "args": (Ref("in0"), 2, Ref("in1")), "kwargs": {}}, source=roll.source)
        return [save, Op(roll.name, "kv_roll", {"src": roll.inputs["src"], "halo": halo}, {"cache": cache},
                         attrs={**roll.attrs, "pieces": len(ranges)}, mutates=("cache",), source=roll.source)]

    return Fusion([roll], (), build)


@register
class KvRoll(Instruction):
    name = "kv_roll"
    #: before ``rms_qkv_rope`` (10) takes the ``kv_write`` after it: nothing matches across it
    rules = (Rule(match=_split, anchors=("kv_roll",), priority=5),)

    @classmethod
    def _ranges(cls, op: Op, g: Graph) -> list[tuple[int, int]]:
        a, n, d, k = _layout(op, g)
        return split_range(n - k, op.attrs.get("pieces", 1)) if "halo" in op.inputs else [(0, n - k)]

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        """One tile per (head, piece): params ``rows`` (flat destination rows ``[r0, r1)``) and
        ``halo`` (the halo row its ``k`` rows past ``r1`` start at, -1 for a head's last piece)."""
        a, n, d, k = _layout(op, g)
        cache, elt = op.outputs["cache"], g.tensors[op.outputs["cache"]].dtype.itemsize
        ranges = cls._ranges(op, g)
        tiles = []
        for h in range(a):
            for j, (s, e) in enumerate(ranges):
                r0, r1 = h * n + s, h * n + e
                last = j == len(ranges) - 1
                src_end = h * n + n if last else r1   # the last piece reads up to the head's end
                reads = [Region.of(g, cache, (r0 + k) * d, src_end * d)] if src_end > r0 + k else []
                hb = -1
                if not last:
                    hb = (h * (len(ranges) - 1) + j) * k
                    reads.append(Region.of(g, op.inputs["halo"], hb * d, (hb + k) * d))
                moved = (r1 - r0) * d * elt
                tiles.append(Tile(op.name, len(tiles), {"rows": (r0, r1), "halo": hb}, reads,
                                  [Region.of(g, cache, r0 * d, r1 * d)], 0, 2 * moved))
        return tiles

    @classmethod
    def encode(cls, op: Op, tile: Tile) -> list[int]:
        return [*tile.params["rows"], tile.params["halo"]]

    call = Call("kv_roll", targs=(Type("tc", "cache"), Int("D", lambda op, g: _layout(op, g)[2]),
                                  Int("K", lambda op, g: _layout(op, g)[3]),
                                  Int("VEC", lambda op, g: int(_layout(op, g)[2] * g.tensors[op.outputs["cache"]]
                                                               .dtype.itemsize % 16 == 0))),
                args=(Ptr("cache"), Ptr("halo"), P0, P1, P2))

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        a, n, d, k = _layout(op, env.g)
        r0, r1 = tile.params["rows"]
        hb = tile.params["halo"]
        flat = env.flat(op.outputs["cache"])
        rows = flat.view(-1, d)
        src = rows[r0 + k:min(r1 + k, (r0 // n + 1) * n)].clone()   # before any store (in place)
        if hb >= 0:
            src = torch.cat([src[:max(0, r1 - r0 - k)],
                             env.flat(op.inputs["halo"]).view(-1, d)[hb:hb + k]])
        rows[r0:r1] = src[:r1 - r0]

