"""matvec_group: sibling linear layers over one input vector as ONE op (a grouped GEMV).

``out_j = W_j @ x (+ b_j)`` for j < S (S <= 4): separate q/k/v projections (OLMo-2, Gemma-2/3,
any family whose q/k/v no norm-fused kind takes), or sibling linears no fused kind takes (gate
and up projections over one vector go to ``rms_gate_up_silu``, with or without its norm). As separate ``matvec`` ops each is a wave of tiles over every SM, and each SM runs
three short tiles in a row, each with its own prologue (stage x) and load ramp: OLMo-2-1B's
q, k and v (8.4 MB each) took 11 µs on the H200, 2.3 TB/s. As one op the rows of all
``W_j`` are one range split over the SMs: a tile stages x once and streams its rows, crossing
from one weight to the next where its range does.

Source: ``torch.nn.functional.linear`` at batch 1 (``aten.mm`` / ``aten.addmm`` with a
transposed weight), each output exactly as :mod:`fusec.instructions.matvec` computes it (the
fp32 dot plus the bias, rounded once). Shapes: x [K], W_j [N_j, K], b_j [N_j], out_j [N_j].
Attributes: ``rows`` the N_j; ``act`` and ``act_outs``: an activation epilogue over the outputs
``out_j`` for j in ``act_outs`` (:mod:`fusec.instructions.activation`: Falcon's and Phi-2's MLP
up projection, grouped with q/k/v under one LayerNorm). Every W_j has one dtype, every out_j one
dtype, all or none have a bias.
"""
from __future__ import annotations

from fusec.ir.env import Env
from fusec.ir import Graph, Op, Role
from fusec.instructions import activation
from fusec.instructions.base import Instruction, Region, Tile, register, split_range
from fusec.instructions.call import P0, P1, SMEM, Call, Flag, Int, Ptr, Type
from fusec.instructions.matvec_rows import elt, staged
from fusec.instructions.prologue import STAGED, TakesPrologue, adjust_tiles, vec_inputs, xin
from fusec.instructions.rule import Ctx, Fusion, Rule

#: at most this many sibling linears in one op (q/k/v: 3; gate/up: 2)
MAX_GROUP = 4


def _vector_linear(g: Graph, op: Op) -> bool:
    """A batch-1 ``linear`` whose weight (and bias) are weights of the model: W [N, K], x of K
    elements, b of N."""
    if op.kind != "linear" or "x" not in op.inputs or "w" not in op.inputs:
        return False
    w = g.tensors[op.inputs["w"]]   # (a row view of a weight, split_linear's, is the weight's: its root's role)
    if len(w.shape) != 2 or g.tensors[op.inputs["x"]].numel != w.shape[1] or \
            g.tensors[g.root(w.name)].role != Role.WEIGHT:
        return False
    if "b" in op.inputs:
        b = g.tensors[op.inputs["b"]]
        if b.numel != w.shape[0] or g.tensors[g.root(b.name)].role != Role.WEIGHT:
            return False
    return not any(g.tensors[t].sym for t in list(op.inputs.values()) + list(op.outputs.values()))


def _siblings(c: Ctx, anchor: Op) -> Fusion | None:
    """The anchor ``linear`` and the later ``linear`` ops that read the same vector (one root
    buffer) with weights of the same K and dtype, outputs of one dtype and a bias each or none:
    one ``matvec_group`` at the place of the FIRST of them (each reads only x and weights, so
    none of its inputs is made later; a sibling's output may be read before the last one)."""
    g = c.g
    if not _vector_linear(g, anchor):
        return None
    x = g.root(anchor.inputs["x"])
    key = (g.tensors[anchor.inputs["w"]].shape[1], g.tensors[anchor.inputs["w"]].dtype,
           g.tensors[anchor.outputs["out"]].dtype, "b" in anchor.inputs)
    group = [anchor]
    for o in g.ops[g.ops.index(anchor) + 1:]:
        if len(group) == MAX_GROUP or any(g.root(t) == x for t in o.writes()):
            break   # (x updated in place: a later linear reads another vector)
        if o.kind != "linear" or not _vector_linear(g, o) or g.root(o.inputs["x"]) != x:
            continue
        if (g.tensors[o.inputs["w"]].shape[1], g.tensors[o.inputs["w"]].dtype,
                g.tensors[o.outputs["out"]].dtype, "b" in o.inputs) == key:
            group.append(o)
    if len(group) < 2:
        return None

    def build() -> list[Op]:
        inputs = {"x": anchor.inputs["x"]}
        outputs = {}
        for j, o in enumerate(group):
            inputs[f"w{j}"] = o.inputs["w"]
            if "b" in o.inputs:
                inputs[f"b{j}"] = o.inputs["b"]
            outputs[f"out{j}"] = o.outputs["out"]
        rows = [g.tensors[o.inputs["w"]].shape[0] for o in group]
        return [Op(g.fresh_name(MatvecGroup.name), MatvecGroup.name, inputs, outputs,
                   attrs={"rows": rows}, source=anchor.source)]
    return Fusion(group, tuple(o.outputs["out"] for o in group), build, place="first")


def _segments(op: Op, r0: int, r1: int) -> list[tuple[int, int, int]]:
    """(j, lo, hi): the rows ``[lo, hi)`` of W_j that the global rows ``[r0, r1)`` cover."""
    out, off = [], 0
    for j, n in enumerate(op.attrs["rows"]):
        lo, hi = max(r0, off), min(r1, off + n)
        if hi > lo:
            out.append((j, lo - off, hi - off))
        off += n
    return out


def _rows(j: int):
    """N_j (0 past the group's last linear; the template's default for j > 0)."""
    return Int(f"N{j}", lambda op, g: op.attrs["rows"][j] if j < len(op.attrs["rows"]) else 0,
               default=0 if j else None)


@register
class MatvecGroup(TakesPrologue, Instruction):
    name = "matvec_group"
    #: before the single-linear ``matvec`` rule (70), after the norm-fused kinds
    rules = (Rule(match=_siblings, anchors=("linear",), priority=65),
             # a GELU over one output as the op's epilogue (fusec/instructions/activation.py)
             *activation.epilogue_rules("matvec_group", 66, grouped=True))

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        """About ``want`` tiles over the rows of all W_j together, each reading x whole (with a
        folded prologue: its inputs)."""
        K = g.tensors[xin(op)].numel
        vec = vec_inputs(op, False)
        tiles = []
        for i, (r0, r1) in enumerate(split_range(sum(op.attrs["rows"]), want)):
            reads, writes = [Region.whole(g, v) for v in vec], []
            wbytes, abytes = 0, sum(g.tensors[v].nbytes for v in vec)
            for j, lo, hi in _segments(op, r0, r1):
                w, out = op.inputs[f"w{j}"], op.outputs[f"out{j}"]
                reads.append(Region.of(g, w, lo * K, hi * K))
                wbytes += (hi - lo) * K * elt(g, w)
                if f"b{j}" in op.inputs:
                    reads.append(Region.of(g, op.inputs[f"b{j}"], lo, hi))
                    wbytes += (hi - lo) * elt(g, op.inputs[f"b{j}"])
                writes.append(Region.of(g, out, lo, hi))
                abytes += (hi - lo) * elt(g, out)
            tiles.append(Tile(op.name, i, {"rows": [r0, r1]}, reads, writes, wbytes, abytes))
        return adjust_tiles(op, g, tiles)

    call = Call("matvec_group",
                targs=(Type("tx", "x"), Type("tw", "w0"), Type("tb", "b0", "w0"), Type("to", "out0"),
                       Int("K", lambda op, g: g.tensors[xin(op)].numel), Flag("bias", has="b0"),
                       _rows(0), _rows(1), _rows(2), _rows(3), STAGED, activation.ACT, activation.ACT_OUTS),
                args=(Ptr("x"), Ptr("w0"), Ptr("w1"), Ptr("w2"), Ptr("w3"), Ptr("b0"), Ptr("b1"), Ptr("b2"),
                      Ptr("b3"), Ptr("out0"), Ptr("out1"), Ptr("out2"), Ptr("out3"), P0, P1, SMEM))

    @classmethod
    def own_smem(cls, op: Op, g: Graph) -> int:
        return g.tensors[xin(op)].numel

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        r0, r1 = tile.params["rows"]
        x = staged(op, env, False)
        for j, lo, hi in _segments(op, r0, r1):
            y = env.read(op.inputs[f"w{j}"])[lo:hi].float() @ x
            if f"b{j}" in op.inputs:
                y = y + env.read(op.inputs[f"b{j}"]).reshape(-1)[lo:hi].float()
            out = op.outputs[f"out{j}"]
            dt = env.g.tensors[out].dtype
            env.flat(out)[lo:hi] = activation.apply(activation.act_of(op, j), y, dt).to(dt)
