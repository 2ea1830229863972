"""rms_qkv_rope: RMSNorm + Q/K/V rows + (per-head q/k RMSNorm) + RoPE + KV-cache append.

One tile owns a range of heads over the concatenation [q heads | k heads | v heads]. It
recomputes the RMSNorm of x (a few KB), multiplies its weight rows, applies the optional
per-head RMSNorm (Qwen3 ``q_norm``/``k_norm``) and RoPE (Su et al. 2021, half-split layout,
cos/sin looked up at the position in tables folded at compile time), then writes q heads to
``q`` and k/v heads into row ``kv_pos`` of the KV caches.

Shapes: x [H]; norm_w [H]; wq [Hq*D, H]; wk, wv [Hkv*D, H]; optional biases bq [Hq*D], bk, bv
[Hkv*D] (Qwen2: ``addmm``, the bias added to the fp32 dot before the projection's rounding);
cos_table, sin_table [L, .., D]; kcache, vcache [1, Hkv, L, D]; q [Hq*D]. Numerics: fp32 math,
rounded to the model dtype where PyTorch rounds (after the norm, after each projection, after
RoPE).
"""
from __future__ import annotations

import torch

from fusec.ir.env import Env
from fusec.ir import Graph, Op
from fusec.ir.semantics import rms_normalize
from fusec.instructions.base import Instruction, Region, Tile, register, split_range
from fusec.instructions.matvec_rows import elt, rms_prologue


@register
class RmsQkvRope(Instruction):
    name = "rms_qkv_rope"

    @classmethod
    def _layout(cls, op: Op, g: Graph):
        a = op.attrs
        return a["n_q"], a["n_kv"], a["head_dim"], g.tensors[op.outputs["kcache"]].shape[2]

    @classmethod
    def _units(cls, op: Op, g: Graph):
        """Work units: (head, rotation pair) over [q | k | v] heads; a pair is rows i, i+D/2."""
        nq, nkv, d, L = cls._layout(op, g)
        half = d // 2
        align = half if "q_norm_w" in op.inputs else 1   # a per-head norm needs whole heads
        return (nq + 2 * nkv) * half, half, align

    @classmethod
    def _spans(cls, op: Op, g: Graph, u0: int, u1: int):
        """(head, p0, p1) pieces of the unit range [u0, u1)."""
        _, half, _ = cls._units(op, g)
        for h in range(u0 // half, (u1 - 1) // half + 1):
            yield h, max(u0 - h * half, 0), min(u1 - h * half, half)

    @classmethod
    def tiles(cls, op: Op, g: Graph, want: int) -> list[Tile]:
        nq, nkv, d, L = cls._layout(op, g)
        n_units, half, align = cls._units(op, g)
        hid = g.tensors[op.inputs["wq"]].shape[1]
        vec = [op.inputs[s] for s in ("x", "norm_w", "cos_table", "sin_table", "rope_pos", "kv_pos",
                                      "q_norm_w", "k_norm_w", "bq", "bk", "bv") if s in op.inputs]
        tiles = []
        for i, (u0, u1) in enumerate(split_range(n_units, want, align)):
            reads = [Region.whole(g, v) for v in vec]
            writes, wbytes = [], 0
            for h, p0, p1 in cls._spans(op, g, u0, u1):
                w, out, row = cls._head(op, h, nq, nkv)
                for a, b in ((p0, p1), (half + p0, half + p1)):
                    reads.append(Region.of(g, op.inputs[w], (row * d + a) * hid, (row * d + b) * hid))
                    wbytes += (b - a) * hid * elt(g, op.inputs[w])
                    if out == "q":
                        writes.append(Region.of(g, op.outputs["q"], row * d + a, row * d + b))
                if out != "q":
                    writes.append(Region.of(g, op.outputs[out], row * L * d, (row + 1) * L * d))
            abytes = sum(g.tensors[v].nbytes for v in vec if g.tensors[g.root(v)].role.value != "constant") \
                + 2 * (u1 - u0) * 2 * elt(g, op.inputs["x"])
            tiles.append(Tile(op.name, i, {"units": [u0, u1]}, _merge(reads), _merge(writes), wbytes, abytes))
        return tiles

    @classmethod
    def cuda_args(cls, op: Op, g: Graph, bufs) -> dict:
        i, o, a = op.inputs, op.outputs, op.attrs
        nq, nkv, d, L = cls._layout(op, g)
        hn = "q_norm_w" in i
        args = {"tx": bufs.ctype(i["x"]), "tnw": bufs.ctype(i["norm_w"]), "tn": bufs.cname(a["norm_dtype"]),
                "tw": bufs.ctype(i["wq"]), "to": bufs.ctype(o["q"]), "tt": bufs.ctype(i["cos_table"]),
                "tc": bufs.ctype(o["kcache"]), "thn": bufs.ctype(i["q_norm_w"]) if hn else bufs.ctype(i["norm_w"]),
                "H": g.tensors[i["x"]].numel, "NQ": nq, "NKV": nkv, "D": d, "L": L,
                "RP": g.tensors[i["cos_table"]].shape[0],
                "headnorm": "true" if hn else "false", "eps": repr(float(a["eps"])),
                "qk_eps": repr(float(a.get("qk_eps", 0.0))),
                "q_norm_w": bufs.ptr(i["q_norm_w"]) if hn else "nullptr",
                "k_norm_w": bufs.ptr(i["k_norm_w"]) if hn else "nullptr",
                "bias": "true" if "bq" in i else "false",
                "wf32": "true" if a.get("w_fp32") else "false"}
        for s in ("bq", "bk", "bv"):
            args[s] = bufs.ptr(i[s]) if s in i else "nullptr"
        args["tb"] = bufs.ctype(i["bq"]) if "bq" in i else args["tw"]
        for s in ("x", "norm_w", "wq", "wk", "wv", "cos_table", "sin_table", "rope_pos", "kv_pos"):
            args[s] = bufs.ptr(i[s])
        for s in ("q", "kcache", "vcache"):
            args[s] = bufs.ptr(o[s])
        if g.tensors[g.root(o["kcache"])].shape[0] != 1:
            raise NotImplementedError("rms_qkv_rope: KV cache batch must be 1")
        return args

    @classmethod
    def smem_floats(cls, op: Op, g: Graph) -> int:
        return g.tensors[op.inputs["x"]].numel + op.attrs["head_dim"]

    @staticmethod
    def _head(op: Op, h: int, nq: int, nkv: int) -> tuple[str, str, int]:
        if h < nq:
            return "wq", "q", h
        if h < nq + nkv:
            return "wk", "kcache", h - nq
        return "wv", "vcache", h - nq - nkv

    @classmethod
    def runtime_regions(cls, op, tile, env):
        nq, nkv, d, L = cls._layout(op, env.g)
        half = d // 2
        pos = int(env.read(op.inputs["kv_pos"]).reshape(-1)[0])
        writes = []
        for h, p0, p1 in cls._spans(op, env.g, *tile.params["units"]):
            _, out, row = cls._head(op, h, nq, nkv)
            base = row * d if out == "q" else row * L * d + pos * d
            for a, b in ((p0, p1), (half + p0, half + p1)):
                writes.append(Region.of(env.g, op.outputs[out], base + a, base + b))
        return tile.reads, writes

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        nq, nkv, d, L = cls._layout(op, env.g)
        half = d // 2
        a = op.attrs
        dt = a["dtype"]
        n = rms_prologue(op, env)
        rp = int(env.read(op.inputs["rope_pos"]).reshape(-1)[0])
        cos = env.read(op.inputs["cos_table"])[rp].reshape(-1).float()
        sin = env.read(op.inputs["sin_table"])[rp].reshape(-1).float()
        kv_pos = int(env.read(op.inputs["kv_pos"]).reshape(-1)[0])
        for h, p0, p1 in cls._spans(op, env.g, *tile.params["units"]):
            w, out, row = cls._head(op, h, nq, nkv)
            wt = env.read(op.inputs[w])
            lo = slice(row * d + p0, row * d + p1)
            hi = slice(row * d + half + p0, row * d + half + p1)
            y1, y2 = wt[lo].float() @ n, wt[hi].float() @ n
            if "bq" in op.inputs:
                b = env.read(op.inputs["b" + w[1]]).reshape(-1).float()
                y1, y2 = y1 + b[lo], y2 + b[hi]
            y1, y2 = y1.to(dt).float(), y2.to(dt).float()
            if out != "vcache":
                nw = op.inputs.get("q_norm_w" if out == "q" else "k_norm_w")
                if nw is not None:  # whole head (p0 = 0, p1 = half)
                    y = rms_normalize(torch.cat([y1, y2]).to(dt), env.read(nw), a["qk_eps"], dt).float()
                    y1, y2 = y[:half], y[half:]
                c1, c2 = cos[p0:p1], cos[half + p0:half + p1]
                s1, s2 = sin[p0:p1], sin[half + p0:half + p1]
                y1, y2 = y1 * c1 - y2 * s1, y2 * c2 + y1 * s2
            if out == "q":
                f = env.flat(op.outputs["q"])
                f[row * d + p0:row * d + p1] = y1.to(dt)
                f[row * d + half + p0:row * d + half + p1] = y2.to(dt)
            else:
                cache = env.read(op.outputs[out])
                cache[0, row, kv_pos, p0:p1] = y1.to(cache.dtype)
                cache[0, row, kv_pos, half + p0:half + p1] = y2.to(cache.dtype)


def _merge(regions: list[Region]) -> list[Region]:
    """Join adjacent regions of the same buffer."""
    out: list[Region] = []
    for r in regions:
        if out and out[-1].tensor == r.tensor and out[-1].stop == r.start:
            out[-1] = Region(r.tensor, out[-1].start, r.stop)
        else:
            out.append(r)
    return out
