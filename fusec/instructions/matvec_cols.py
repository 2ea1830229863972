"""matvec_cols: ``out = x @ W (+ b)`` with the weight stored [in, out]: HF's ``Conv1D`` (GPT-2).

Source: ``torch.addmm(b, x, W)`` / ``torch.mm(x, W)`` at batch 1 with a weight ``W`` [K, N]
(``transformers.pytorch_utils.Conv1D``: ``addmm(bias, x.view(-1, nx), weight)``), which the
``linear`` pattern (a transposed weight) does not see, and the residual add that may follow it
(``aten.add``, GPT-2's attention and MLP outputs). Numerics follow PyTorch: the fp32 dot plus
the bias, rounded once to the output dtype (``addmm``), then the residual added and rounded
again; or, where the product feeds a GELU (``aten.gelu``, exact or tanh, or GPT-2's
``NewGELUActivation``, ``0.5 * y * (1 + tanh(sqrt(2 / pi) * (y + 0.044715 * y ** 3)))``, eight
ATen ops), that activation as the op's epilogue (attribute ``act``: the rules of
:mod:`fusec.instructions.activation`, as ``matvec`` takes them), applied with eager's rounding. Shapes: x [K] (leading dims of size 1), W [K, N], b [N], residual [N], out [N].
Tiles are column groups of ``NCH`` 16-byte chunks, at most :data:`TARGET_GROUPS` of them,
spread over every SM (the generic form runs the whole product on one SM); a tile reads its
columns' segment of every row (template ``matvec_cols.cu.j2``: one group per tile).

Prologue: like the row-tiled kinds, ``matvec_cols`` takes a folded prologue
(:mod:`fusec.instructions.prologue`, the ``prologue`` pass): GPT-2's LayerNorms (``ln_1`` before
``c_attn``, ``ln_2`` before ``c_fc``), or an RMSNorm or other small vector ops in front of a
``Conv1D``, are recomputed by every tile from their inputs (a few KB) into the staged ``x``
(shared memory, in x's dtype: each member's output rounded to its dtype as eager does), and no
longer stand alone as a dependency level on one SM. The writer tile is the one whose first
column is 0.

Cache epilogue (:mod:`fusec.instructions.kv_epilogue`): where the product's pieces are written
into KV caches (GPT-2's ``c_attn`` split into q, k and v, k and v appended at the position), the
tiles store the k and v columns they compute into the caches' rows too (attribute ``kv_cols``),
and the q piece is a view of the product: the split and the writes no longer stand alone.
"""
from __future__ import annotations

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.ir.pattern import op, var
from fusec.instructions import activation, kv_epilogue
from fusec.instructions.base import Instruction, Region, Tile, register, split_range
from fusec.instructions.call import P0, P1, SMEM, Call, Flag, Int, Ptr, Type
from fusec.instructions.matvec_rows import elt, staged
from fusec.instructions.prologue import STAGED, TakesPrologue, adjust_tiles, vec_inputs, xin
from fusec.instructions.rule import Rule

#: column groups per matrix the chunk width aims at (about one per SM)
TARGET_GROUPS = 128


def _weight(g: Graph, t: str) -> bool:
    return Instruction.is_weight(g, t) and len(g.tensors[t].shape) == 2


def _shape_ok(g: Graph, m: dict) -> bool:
    """Batch 1, ``beta = alpha = 1``, rows of whole 16-byte chunks: x has K elements, W is
    [K, N], the bias and the output N elements, N * (W's element bytes) a multiple of 16."""
    K, N = g.tensors[m["w"]].shape
    kw = m["_anchor"].attrs.get("kwargs", {})
    out = m["_anchor"].outputs["out"]
    return (kw.get("beta", 1) == 1 and kw.get("alpha", 1) == 1 and g.tensors[m["x"]].numel == K
            and g.tensors[out].numel == N and ("b" not in m or g.tensors[m["b"]].numel == N)
            and (N * elt(g, m["w"])) % 16 == 0 and g.tensors[out].dtype.is_floating_point)


def chunks_per_group(g: Graph, w: str) -> int:
    """NCH: 16-byte chunks per row segment a group of a tile reads (a power of two up to 32),
    the smallest that makes at most :data:`TARGET_GROUPS` groups of the N columns."""
    K, N = g.tensors[w].shape
    e = 16 // elt(g, w)
    nch = 1
    while nch < 32 and -(-N // (nch * e)) > TARGET_GROUPS:
        nch *= 2
    return nch


def _residual_ok(g: Graph, m: dict) -> bool:
    """The add: two tensor operands, alpha 1, a residual other than the product itself, residual,
    product and sum of one size and dtype; the product as :func:`_shape_ok` wants it."""
    add = m["_anchor"]
    mm = next(o for o in m["_ops"] if o.kind == "aten.addmm.default")
    out = add.outputs["out"]
    n, dt = g.tensors[out].numel, g.tensors[out].dtype
    return ("in0" in add.inputs and "in1" in add.inputs and add.attrs["kwargs"].get("alpha", 1) == 1
            and g.root(m["residual"]) != g.root(m["y"])   # not y + y: the op would read its own output
            and g.tensors[m["residual"]].numel == n and g.tensors[m["y"]].numel == n
            and g.tensors[m["y"]].dtype == dt and _shape_ok(g, {**m, "_anchor": mm}))


@register
class MatvecCols(TakesPrologue, Instruction):
    name = "matvec_cols"
    rules = (Rule(op("aten.add.Tensor", var("residual"),
                     op("aten.addmm.default", var("b"), var("x"), var("w", _weight), bind="y"), commutative=True),
                  inputs={"x": "x", "w": "w", "b": "b", "residual": "residual"}, outputs={"out": "_anchor.out"},
                  check=_residual_ok, priority=44),
             Rule(op("aten.addmm.default", var("b"), var("x"), var("w", _weight)),
                  inputs={"x": "x", "w": "w", "b": "b"}, outputs={"out": "_anchor.out"}, check=_shape_ok,
                  priority=72, keep_name=True),
             Rule(op("aten.mm.default", var("x"), var("w", _weight)),
                  inputs={"x": "x", "w": "w"}, outputs={"out": "_anchor.out"}, check=_shape_ok,
                  priority=74, keep_name=True),
             # a GELU over its output (aten.gelu, gelu_new's chain) as its epilogue, after the
             # rules above made the op (fusec/instructions/activation.py)
             *activation.epilogue_rules("matvec_cols", 81),
             # k/v pieces of the product written into the KV caches' rows (fusec/instructions/kv_epilogue.py)
             kv_epilogue.RULE)

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        """One tile per column group (at most :data:`TARGET_GROUPS`), each reading every row of
        W, x whole (with a folded prologue: the members' inputs; the writer tile also writes
        the kept outputs) and its columns of the bias and residual."""
        w, out = op.inputs["w"], op.outputs["out"]
        K, N = g.tensors[w].shape
        group = chunks_per_group(g, w) * (16 // elt(g, w))
        vec = vec_inputs(op, False)
        tiles = []
        # one column group per tile (at most TARGET_GROUPS): on fewer SMs an SM takes several tiles
        for i, (c0, c1) in enumerate(split_range(N, -(-N // group), group)):
            reads = [Region.whole(g, w)] + [Region.whole(g, v) for v in vec]
            abytes = sum(g.tensors[v].nbytes for v in vec) + (c1 - c0) * elt(g, out)
            for s in ("b", "residual"):
                if s in op.inputs:
                    reads.append(Region.of(g, op.inputs[s], c0, c1))
                    abytes += (c1 - c0) * elt(g, op.inputs[s])
            kv_reads, kv_writes, kv_bytes = kv_epilogue.tile_regions(op, g, c0, c1)
            tiles.append(Tile(op.name, i, {"cols": [c0, c1]}, reads + kv_reads, [Region.of(g, out, c0, c1)] + kv_writes,
                              K * (c1 - c0) * elt(g, w), abytes + kv_bytes))
        return adjust_tiles(op, g, tiles)

    @classmethod
    def encode(cls, op: Op, tile: Tile) -> list[int]:
        return list(tile.params["cols"])

    call = Call("matvec_cols", targs=(Type("tx", "x"), Type("tw", "w"), Type("tb", "b", "w"),
                                      Type("tr", "residual", "out"), Type("to", "out"),
                                      Int("K", lambda op, g: g.tensors[op.inputs["w"]].shape[0]),
                                      Int("N", lambda op, g: g.tensors[op.inputs["w"]].shape[1]),
                                      Int("NCH", lambda op, g: chunks_per_group(g, op.inputs["w"])),
                                      Flag("bias", has="b"), Flag("add_res", has="residual"),
                                      Int("ACT", activation.code),
                                      STAGED, *kv_epilogue.TARGS),
                args=(Ptr("x"), Ptr("w"), Ptr("b"), Ptr("res", "residual"), Ptr("out"), P0, P1, SMEM,
                      *kv_epilogue.ARGS))

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs) -> dict:
        kv_epilogue.check_lengths(op, bufs)
        return super().cuda_args(op, g, bufs)

    @classmethod
    def runtime_regions(cls, op: Op, tile: Tile, env: Env):
        """With a cache epilogue, the caches' rows at this step's position (planned: every row)."""
        if "kv_cols" not in op.attrs:
            return tile.reads, tile.writes
        cached = {env.g.root(c) for c, _, _ in kv_epilogue.caches(op)}
        c0, c1 = tile.params["cols"]
        return tile.reads, [r for r in tile.writes if r.tensor not in cached] + \
            kv_epilogue.runtime_writes(op, env, c0, c1)

    @classmethod
    def own_smem(cls, op: Op, g: Graph) -> int:
        """The staged x (rounded up to 16 bytes), then one group's sums per warp (at most 32);
        a folded prologue's intermediates come after them (:class:`TakesPrologue`)."""
        w = op.inputs["w"]
        K = g.tensors[w].shape[0]
        return (K * elt(g, xin(op)) + 15) // 16 * 4 + 32 * chunks_per_group(g, w) * (16 // elt(g, w))

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        c0, c1 = tile.params["cols"]
        x = staged(op, env, False)   # x, or the folded prologue's result (rounded as eager rounds it)
        y = x @ env.read(op.inputs["w"])[:, c0:c1].float()
        dt = env.g.tensors[op.outputs["out"]].dtype
        if "b" in op.inputs:
            y = y + env.read(op.inputs["b"]).reshape(-1)[c0:c1].float()
        if "residual" in op.inputs:
            y = env.read(op.inputs["residual"]).reshape(-1)[c0:c1].float() + y.to(dt).float()
        y = activation.apply(activation.act_of(op), y, dt)
        env.flat(op.outputs["out"])[c0:c1] = y.to(dt)
        kv_epilogue.run(op, env, c0, c1, y.to(dt))

