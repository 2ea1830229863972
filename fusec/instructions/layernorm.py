"""layernorm: ``out = (x - mean(x)) * rsqrt(var(x) + eps) * w + b`` over the last dim.

Source: ``torch.nn.functional.layer_norm`` (``aten.native_layer_norm``; Ba et al. 2016), as
GPT-NeoX/Pythia, StableLM, Falcon and OLMo use it; ``w`` and ``b`` are optional (OLMo's
non-parametric norm has neither). Numerics follow PyTorch: mean and biased variance in fp32,
the affine map in fp32, one rounding to the output dtype. Shapes: x [H] (any leading dims of
size 1), w [H], b [H], out like x. One tile: the vector is a few KB; the matvecs that read
``out`` spread over every SM.
"""
from __future__ import annotations

import torch

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.instructions.base import Instruction, Region, Tile, register
from fusec.instructions.call import RED, Call, Flag, Float, Int, Ptr, Type


@register
class LayerNorm(Instruction):
    name = "layernorm"

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        reads = [Region.whole(g, t) for t in op.reads()]
        out = op.outputs["out"]
        return [Tile(op.name, 0, {}, reads, [Region.whole(g, out)], 0,
                     sum(g.tensors[t].nbytes for t in op.reads()) + g.tensors[out].nbytes)]

    call = Call("layernorm", targs=(Type("tx", "x"), Type("tw", "w", "b", otherwise="float"), Type("to", "out"),
                                    Int("H", lambda op, g: g.tensors[op.inputs["x"]].numel),
                                    Flag("has_w", has="w"), Flag("has_b", has="b")),
                args=(Ptr("x"), Ptr("w"), Ptr("b"), Float("eps", "eps"), Ptr("out"), RED),
                numbering=("x", "out", "w", "b"))

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        x = env.read(op.inputs["x"]).reshape(-1).float()
        w = env.read(op.inputs["w"]).reshape(-1).float() if "w" in op.inputs else None
        b = env.read(op.inputs["b"]).reshape(-1).float() if "b" in op.inputs else None
        y = torch.nn.functional.layer_norm(x, (x.numel(),), w, b, op.attrs["eps"])
        env.flat(op.outputs["out"])[:] = y.to(env.g.tensors[op.outputs["out"]].dtype)
