"""rms_lm_head: ``out = W @ RMSNorm(x)`` over rows (final norm + LM head; any norm+linear),
optionally with the greedy token ``argmax(out)`` as an epilogue.

Source: HF ``LlamaForCausalLM`` final ``norm`` and ``lm_head``; ``torch.argmax`` over the
logits (greedy decoding). Shapes: x [H], norm_w [H], W [V, H], out [V] (the logits).

Argmax epilogue (outputs ``cand`` fp32 [S, 2] and ``token`` int64 [1]; ``fuse`` adds them when
the graph takes ``argmax(logits, -1)``): tile i of the NT tiles writes its rows' best logit,
rounded to the logits' dtype as PyTorch compares them, and its row index into ``cand[i]``
(the first index among equal values); after a barrier it takes an atomic ticket (one
acquire-release ``atom.inc`` counting 0 .. NT-1, as the split-KV merge does) and the tile that
takes the last ticket of the step merges the NT candidates into ``token`` (largest value, first
index among equals: ``torch.argmax``'s tie rule). Every tile declares ``token`` as written, so a
consumer waits for all of them. NaN ranks above every number, as in ``torch.argmax``.
"""
from __future__ import annotations

import torch

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.ir.pattern import ABSENT, op, sem, var
from fusec.instructions.base import Instruction, Region, Tile, register, split_range
from fusec.instructions.call import P0, P1, RED, SMEM, Call, Expr, Float, Int, Local, Ptr
from fusec.instructions.matvec_rows import HIDDEN, WF32, rms_attrs, rms_types, row_tiles, staged
from fusec.instructions.prologue import STAGED, TakesPrologue, adjust_tiles, vec_inputs, xin
from fusec.instructions.rule import Ctx, Rule


def _argmax(op: Op) -> bool:
    return "token" in op.outputs


def n_tiles(op: Op, g: Graph) -> int:
    """Tiles of an argmax head: its rows over at most one tile per candidate slot."""
    return len(split_range(g.tensors[op.inputs["w"]].shape[0], g.tensors[op.outputs["cand"]].shape[0]))


def _argmax_ok(g: Graph, m: dict) -> bool:
    """The head has no token yet, its logits are one row per weight row, and the argmax is over
    the last dim to one token."""
    am, head = m["_anchor"], m["head"]
    args, nd = am.attrs["args"], len(g.tensors[am.inputs["in0"]].shape)
    dim = args[1] if len(args) > 1 else am.attrs["kwargs"].get("dim")
    return "token" not in head.outputs \
        and g.tensors[head.outputs["out"]].numel == g.tensors[head.inputs["w"]].shape[0] \
        and g.tensors[am.outputs["out"]].numel == 1 and (dim is None or dim % nd == nd - 1)


def _add_token(c: Ctx, m: dict) -> list:
    """The argmax goes; the head gets the ``cand`` and ``token`` outputs (in place)."""
    head, am = m["head"], m["_anchor"]
    head.outputs["cand"] = c.g.new_tensor(f"{head.name}_cand", (c.options["num_sms"], 2), torch.float32)
    head.outputs["token"] = am.outputs["out"]
    return []


@register
class RmsLmHead(TakesPrologue, Instruction):
    name = "rms_lm_head"
    rules = (
        #: RMSNorm -> one linear (no bias): the final norm and the LM head, or any such pair
        Rule(sem("linear", x=sem("rmsnorm", "rms", x=var("x"), w=var("norm_w")), w=var("w"), b=ABSENT),
             inputs={"x": "x", "norm_w": "norm_w", "w": "w"}, outputs={"out": "_anchor.out"},
             attrs=lambda g, m: {**rms_attrs(g, m["rms"]), "w_fp32": m["rms"].attrs.get("w_fp32", False)},
             priority=50),
        #: ``argmax(logits, -1)`` of its logits (greedy decoding in the step) becomes its token
        Rule(op("aten.argmax.default", sem("rms_lm_head", "head"), partial=True), check=_argmax_ok,
             build=_add_token, priority=60),
    )

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        rows = g.tensors[op.inputs["w"]].shape[0]
        if "token" in op.outputs:
            want = min(want, g.tensors[op.outputs["cand"]].shape[0])
        tiles = adjust_tiles(op, g, row_tiles(op, g, want, [op.inputs["w"]], vec_inputs(op, True), [],
                                              op.outputs["out"], rows))
        if "token" in op.outputs:
            nt = len(tiles)
            for i, t in enumerate(tiles):
                t.params["index"], t.params["nt"] = i, nt
                t.writes += [Region.of(g, op.outputs["cand"], 2 * i, 2 * i + 2), Region.whole(g, op.outputs["token"])]
                t.reads += [Region.of(g, op.outputs["cand"], 0, 2 * nt)]   # the merge, if last
                t.act_bytes += 16
        return tiles

    @classmethod
    def encode(cls, op: Op, tile: Tile) -> list[int]:
        return [*tile.params["rows"], tile.params.get("index", 0)]

    call = Call(lambda op: "rms_lm_head_argmax" if _argmax(op) else "rms_lm_head",
                targs=(*rms_types("w"), HIDDEN, Int("NT", n_tiles, when=_argmax), WF32, STAGED),
                args=(Ptr("x"), Ptr("norm_w"), Float("eps", "eps", fallback=0.0), Ptr("w"), Ptr("out"),
                      Ptr("cand", when=_argmax), Ptr("token", when=_argmax),
                      Expr("ticket", lambda op, g, bufs: bufs.counters(op.name, 1), when=_argmax),
                      P0, P1, Local("in.p2", when=_argmax), SMEM, RED),
                numbering=("x", "norm_w", "out", "w", "cand", "token"))

    @classmethod
    def own_smem(cls, op: Op, g: Graph) -> int:
        return g.tensors[xin(op)].numel

    @classmethod
    def runtime_regions(cls, op: Op, tile: Tile, env: Env):
        if "token" not in op.outputs:
            return tile.reads, tile.writes
        return tile.reads[:-1], [w for w in tile.writes if w.tensor != env.g.root(op.outputs["token"])]

    @classmethod
    def ticket_regions(cls, op: Op, tile: Tile, env: Env):
        """The merge, after the ticket: every candidate and the token, if this tile's ticket is
        the step's last."""
        if "token" not in op.outputs:
            return [], []
        nt = tile.params["nt"]
        if env.peek_ticket(op.name) % nt != nt - 1:
            return [], []
        return [Region.of(env.g, op.outputs["cand"], 0, 2 * nt)], [Region.whole(env.g, op.outputs["token"])]

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        r0, r1 = tile.params["rows"]
        dt = env.g.tensors[op.outputs["out"]].dtype
        n = env.once((op.name, "staged"), lambda: staged(op, env, True))   # alike for every tile
        logits = (env.read(op.inputs["w"])[r0:r1].float() @ n).to(dt)
        env.flat(op.outputs["out"])[r0:r1] = logits
        if "token" not in op.outputs:
            return
        nt, i = tile.params["nt"], tile.params["index"]   # nt: this tiling's (1 in the reference executor)
        cand = env.flat(op.outputs["cand"])
        best = int(torch.argmax(logits.float()))     # first index of the maximum
        cand[2 * i], cand[2 * i + 1] = float(logits[best]), float(r0 + best)
        if env.take_ticket(op.name) % nt == nt - 1:
            c = cand[: 2 * nt].view(nt, 2)
            k = int(torch.argmax(c[:, 0]))           # tiles are in row order: first max = first index
            env.flat(op.outputs["token"])[0] = int(c[k, 1])
