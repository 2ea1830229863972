"""argmax_rows: ``out[r] = argmax(x[r, :])`` over the last dim of R rows, split across SMs.

Source: ``torch.argmax(logits, -1)`` (greedy decoding inside a step: a batch's B rows, the K
rows of a speculative verification step, or one row whose logits no ``rms_lm_head`` made, such
as GPT-2's LayerNorm head). Shapes: x [..., V] of R = numel / V rows (fp32, bf16 or fp16;
``dim=None``: one row of every element), out int64 [R] (any shape of R elements, ``keepdim``
included), cand fp32 [R, S, 2] (S candidate slots, ``num_sms`` of them).

Tiles: NT <= S column ranges of V; tile i scans its columns of every row and writes each row's
best (value, column) into ``cand[r, i]`` (the first column among equal values), then takes an
atomic ticket (one acquire-release ``atom.inc`` counting 0 .. NT-1, as ``rms_lm_head``'s argmax
and the split-KV merge do); the tile that takes the step's last ticket merges the NT candidates
of each row into ``out[r]`` (largest value, first column among equals: ``torch.argmax``'s tie
rule; NaN ranks above every number). Every tile declares ``out`` as written, so a consumer waits
for all of them. Before, such an argmax ran generic on one SM over all R·V elements (R·V·2 bytes
on one SM: 1 MB at R = 4 and Llama-3's V = 128256).
"""
from __future__ import annotations

import torch

from fusec.ir import Graph, Op
from fusec.ir.env import Env
from fusec.ir.pattern import op, var
from fusec.instructions.base import Instruction, Region, Tile, register, split_range
from fusec.instructions.call import P0, P1, P2, Call, Expr, Int, Ptr, Type
from fusec.instructions.matvec_rows import MAX_SEQS, elt
from fusec.instructions.rule import Ctx, Rule

#: columns below which one more tile costs more (its ticket and merge) than its scan saves
MIN_COLS = 512
#: the candidates hold a column as an fp32 value: exact below 2**24
MAX_COLS = 1 << 24


def _rows_cols(g: Graph, x: str, dim) -> tuple[int, int]:
    """(R, V): the rows and the reduced length of ``argmax(x, dim)``."""
    t = g.tensors[x]
    if dim is None:
        return 1, t.numel
    return t.numel // t.shape[-1], t.shape[-1]


def _dim(a: Op):
    args = a.attrs["args"]
    return args[1] if len(args) > 1 else a.attrs["kwargs"].get("dim")


def _ok(g: Graph, m: dict) -> bool:
    """A float input, the last dim (or all elements) reduced, at most :data:`MAX_SEQS` rows, more
    than one tile's worth of columns and fewer than :data:`MAX_COLS`, one int64 output element per
    row."""
    am = m["_anchor"]
    x, out = g.tensors[m["x"]], g.tensors[am.outputs["out"]]
    dim = _dim(am)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.sym or not x.shape or x.numel == 0:
        return False
    if dim is not None and (not isinstance(dim, int) or dim % len(x.shape) != len(x.shape) - 1):
        return False
    rows, cols = _rows_cols(g, m["x"], dim)
    return rows <= MAX_SEQS and 2 * MIN_COLS <= cols < MAX_COLS and out.numel == rows and out.dtype == torch.int64


def _build(c: Ctx, m: dict) -> list[Op]:
    am = m["_anchor"]
    rows, cols = _rows_cols(c.g, m["x"], _dim(am))
    cand = c.g.new_tensor(f"{am.name}_cand", (rows, c.options["num_sms"], 2), torch.float32)
    return [Op(am.name, "argmax_rows", {"x": m["x"]}, {"out": am.outputs["out"], "cand": cand},
               attrs={"rows": rows, "cols": cols}, source=am.source)]


def n_tiles(op: Op, g: Graph, want: int | None = None) -> int:
    """Tiles of the op: column ranges of at least :data:`MIN_COLS`, at most one per slot."""
    slots = g.tensors[op.outputs["cand"]].shape[1]
    return len(split_range(op.attrs["cols"], min(slots, want or slots, max(1, op.attrs["cols"] // MIN_COLS))))


@register
class ArgmaxRows(Instruction):
    name = "argmax_rows"
    max_rows = MAX_SEQS
    #: ``argmax(x, -1)`` (or over all elements) of up to 16 rows; after ``rms_lm_head``'s own
    #: argmax epilogue (60), which takes a batch-1 head's
    rules = (Rule(op("aten.argmax.default", var("x"), partial=True), check=_ok, build=_build, priority=85),)

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        rows, cols = op.attrs["rows"], op.attrs["cols"]
        slots = g.tensors[op.outputs["cand"]].shape[1]
        ranges = split_range(cols, n_tiles(op, g, want))
        nt = len(ranges)
        tiles = []
        for i, (c0, c1) in enumerate(ranges):
            reads = [Region.of(g, op.inputs["x"], r * cols + c0, r * cols + c1) for r in range(rows)]
            # then every row's NT candidates: what the merge reads, if this tile's ticket is the last
            reads += [Region.of(g, op.outputs["cand"], r * slots * 2, (r * slots + nt) * 2) for r in range(rows)]
            writes = [Region.of(g, op.outputs["cand"], (r * slots + i) * 2, (r * slots + i + 1) * 2)
                      for r in range(rows)] + [Region.whole(g, op.outputs["out"])]
            tiles.append(Tile(op.name, i, {"cols": (c0, c1), "index": i, "nt": nt}, reads, writes, 0,
                              rows * (c1 - c0) * elt(g, op.inputs["x"]) + rows * 8))
        return tiles

    @classmethod
    def encode(cls, op: Op, tile: Tile) -> list[int]:
        return [*tile.params["cols"], tile.params["index"]]

    call = Call("argmax_rows",
                targs=(Type("tx", "x"), Int("R", lambda op, g: op.attrs["rows"]),
                       Int("V", lambda op, g: op.attrs["cols"]), Int("NT", lambda op, g: n_tiles(op, g)),
                       Int("S", lambda op, g: g.tensors[op.outputs["cand"]].shape[1])),
                args=(Ptr("x"), Ptr("cand"), Ptr("out"),
                      Expr("ticket", lambda op, g, bufs: bufs.counters(op.name, 1)), P0, P1, P2))

    @classmethod
    def runtime_regions(cls, op: Op, tile: Tile, env: Env):
        """Before the ticket: the tile's columns and its candidates."""
        rows = op.attrs["rows"]
        return tile.reads[:rows], tile.writes[:rows]

    @classmethod
    def ticket_regions(cls, op: Op, tile: Tile, env: Env):
        """The merge, after the ticket: every candidate and the output, if this tile's ticket is
        the step's last."""
        nt = tile.params["nt"]
        if env.peek_ticket(op.name) % nt != nt - 1:
            return [], []
        return tile.reads[op.attrs["rows"]:], [Region.whole(env.g, op.outputs["out"])]

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        rows, cols = op.attrs["rows"], op.attrs["cols"]
        c0, c1 = tile.params["cols"]
        i, nt = tile.params["index"], tile.params["nt"]   # nt: this tiling's (1 in the reference executor)
        slots = env.g.tensors[op.outputs["cand"]].shape[1]
        x = env.read(op.inputs["x"]).reshape(rows, cols)[:, c0:c1].float()
        cand = env.flat(op.outputs["cand"]).view(rows, slots, 2)
        best = torch.argmax(x, -1)    # first column of the maximum; NaN ranks highest
        cand[:, i, 0] = x.gather(1, best[:, None])[:, 0]
        cand[:, i, 1] = (best + c0).float()
        if env.take_ticket(op.name) % nt == nt - 1:
            vals = cand[:, :nt, 0]
            k = torch.argmax(vals, -1)   # tiles are in column order: the first max is the first column
            env.flat(op.outputs["out"])[:] = cand[:, :nt, 1].gather(1, k[:, None])[:, 0].long()
