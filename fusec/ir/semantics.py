"""Reference semantics of semantic ops (raised by ``recognize``) and the op dispatcher.

Each function computes a whole op from :class:`fusec.ir.env.Env` in float32 and rounds once
to the output dtype. Sources: HF ``LlamaRMSNorm`` (RMSNorm, Zhang & Sennrich 2019),
``apply_rotary_pos_emb``/``rotate_half`` (RoPE, Su et al. 2021, half-split layout),
``torch.nn.functional.scaled_dot_product_attention`` with grouped-query attention
(Ainslie et al. 2023), SiLU-gated MLP (Shazeer 2020).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from fusec.abi import Fault
from fusec.ir import Op
from fusec.ir.aten_exec import index_fault, run_aten
from fusec.ir.env import Env

SEMANTICS: dict[str, Callable[[Op, Env], None]] = {}
#: instruction kind -> runs one op of that kind whole (its tiling into a single tile); filled by
#: :func:`fusec.instructions.base.register`, so that this lower layer never imports the kinds
WHOLE: dict[str, Callable[[Op, Env], None]] = {}


def semantic(kind: str):
    def deco(fn):
        SEMANTICS[kind] = fn
        return fn
    return deco


def rms_normalize(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype,
                  w_fp32: bool = False) -> torch.Tensor:
    """HF RMSNorm over the last dim: ``w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` in fp32
    (Llama); with ``w_fp32`` the weight multiplies before the one rounding,
    ``(x * rsqrt(mean(x^2) + eps) * w).to(dtype)`` (Gemma, whose ``w`` is ``1 + weight``)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w_fp32:
        return (y * w.float()).to(dtype)
    return (w.float() * y.to(x.dtype).float()).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with the half-split layout: ``x*cos + cat(-x2, x1)*sin`` (fp32 result)."""
    xf = x.float()
    h = xf.shape[-1] // 2
    rot = torch.cat((-xf[..., h:], xf[..., :h]), dim=-1)
    return xf * cos.float() + rot * sin.float()


def apply_mask(s: torch.Tensor, mask: torch.Tensor | None, kind: int) -> torch.Tensor:
    """Scores ``s`` [..., n] (fp32) under an SDPA mask over the same rows: ``kind`` 1, bool
    (False: -inf); 2, additive float; 0 or ``mask`` None: unchanged."""
    if mask is None or not kind:
        return s
    m = mask.reshape(-1)[: s.shape[-1]]
    if kind == 1:
        return s.masked_fill(~m, float("-inf"))
    return s + m.float()


def soft_cap(s: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma-2's attention logit softcap of scaled scores ``s`` (fp32): ``cap * tanh(s / cap)``
    (Gemma 2 report, section 2; HF ``Gemma2`` ``eager_attention_forward``); ``s`` when ``cap``
    is 0."""
    return torch.tanh(s / cap) * cap if cap else s


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, scale: float,
           mask: torch.Tensor | None = None, mask_kind: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Decode attention with GQA over cache positions ``[0, length)``.

    q: [Hq, D]; k, v: [Hkv, L, D]; mask: [L] bool (``mask_kind`` 1) or additive float (2),
    applied after the ``softcap`` (:func:`soft_cap`) of the scaled scores.
    Returns fp32 [Hq, D]. Hq must be a multiple of Hkv.
    """
    hq, hkv = q.shape[0], k.shape[0]
    rep = hq // hkv
    kk = k[:, :length].float().repeat_interleave(rep, 0)
    vv = v[:, :length].float().repeat_interleave(rep, 0)
    s = apply_mask(soft_cap(torch.einsum("hd,hld->hl", q.float(), kk) * scale, softcap), mask, mask_kind)
    p = torch.softmax(s, -1).nan_to_num(0.0)   # every row masked: 0, as SDPA
    return torch.einsum("hl,hld->hd", p, vv)


@semantic("rmsnorm")
def _rmsnorm(op: Op, env: Env) -> None:
    x = env.read(op.inputs["x"])
    env.set(op.outputs["out"], rms_normalize(x, env.read(op.inputs["w"]), op.attrs["eps"],
                                             env.g.tensors[op.outputs["out"]].dtype,
                                             op.attrs.get("w_fp32", False)))


@semantic("linear")
def _linear(op: Op, env: Env) -> None:
    """``y = x @ w^T (+ b)``: x [..., K] (one row per sequence of a batch, or one vector), w
    [N, K]; fp32, rounded once."""
    w = env.read(op.inputs["w"]).float()
    x = env.read(op.inputs["x"]).reshape(-1, w.shape[1]).float()
    y = x @ w.T
    if "b" in op.inputs:
        y = y + env.read(op.inputs["b"]).float()
    info = env.g.tensors[op.outputs["out"]]
    env.set(op.outputs["out"], y.to(info.dtype).reshape(info.shape))


@semantic("rope")
def _rope(op: Op, env: Env) -> None:
    """RoPE over the last dim of x; with ``rotary_dim`` rd < D (partial rotary) the first rd
    values are rotated (cos/sin of width rd) and the rest pass through as they are."""
    info = env.g.tensors[op.outputs["out"]]
    x = env.read(op.inputs["x"])
    rd = op.attrs.get("rotary_dim", x.shape[-1])
    y = rotate(x[..., :rd], env.read(op.inputs["cos"]), env.read(op.inputs["sin"])).to(info.dtype)
    if rd < x.shape[-1]:
        y = torch.cat((y, x[..., rd:].to(info.dtype)), dim=-1)
    env.set(op.outputs["out"], y.reshape(info.shape))


@semantic("silu_mul")
def _silu_mul(op: Op, env: Env) -> None:
    info = env.g.tensors[op.outputs["out"]]
    g = env.read(op.inputs["gate"]).float()
    y = torch.nn.functional.silu(g) * env.read(op.inputs["up"]).float()
    env.set(op.outputs["out"], y.to(info.dtype).reshape(info.shape))


@semantic("gelu_mul")
def _gelu_mul(op: Op, env: Env) -> None:
    info = env.g.tensors[op.outputs["out"]]
    g = env.read(op.inputs["gate"]).float()
    a = torch.nn.functional.gelu(g, approximate="tanh" if op.attrs["act"] == "gelu_tanh" else "none")
    a = a.to(env.g.tensors[op.inputs["gate"]].dtype).float()   # GELU is its own op: rounded
    env.set(op.outputs["out"], (a * env.read(op.inputs["up"]).float()).to(info.dtype).reshape(info.shape))


def _in_range(op: Op, what: str, value: int, bound: int, code: Fault) -> int:
    """``value``, or the simulator's IndexFaultError where the kernel records fault ``code``."""
    if not 0 <= value < bound:
        raise index_fault(op, what, value, bound, code)
    return value


@semantic("kv_write")
def _kv_write(op: Op, env: Env) -> None:
    """``cache[:, :, pos] = val``: one row per (sequence, head) at ``pos``, or with K positions
    (``pos`` [K], K query tokens per sequence) the K rows of ``val`` [B, H, K, D] at them; a
    position outside the cache is fault KV_POS (nothing written)."""
    cache = env.read(op.outputs["cache"])
    val = env.read(op.inputs["val"])
    ps = env.read(op.inputs["pos"]).reshape(-1)
    if ps.numel() == 1:
        pos = _in_range(op, "KV-cache write position", int(ps[0]), cache.shape[2], Fault.KV_POS)
        cache[:, :, pos] = val.reshape(cache.shape[0], cache.shape[1], -1).to(cache.dtype)
        return
    rows = [_in_range(op, "KV-cache write position", int(p), cache.shape[2], Fault.KV_POS) for p in ps]
    cache[:, :, rows] = val.reshape(cache.shape[0], cache.shape[1], len(rows), -1).to(cache.dtype)


#: ``mask_kind`` of an attention whose mask input is its K write positions (a K-token step whose
#: causal mask ``fusec/ir/mask_proofs.py`` proved to be ``row <= pos[k]`` for token k)
TOKEN_POSITIONS = 3


def token_mask(pos: torch.Tensor, length: int) -> torch.Tensor:
    """The bool mask ``[1, 1, K, length]`` of a K-token step from its write positions ``pos``
    [K] (int64, HF's ``cache_position``): token k attends rows ``0 .. pos[k]`` (``mask_kind``
    :data:`TOKEN_POSITIONS`; HF's causal mask over a static cache, ``kv_idx <= q_idx``)."""
    k = pos.numel()
    ar = torch.arange(length, device=pos.device)
    return (ar[None, :] <= pos.reshape(-1).to(torch.int64)[:, None]).reshape(1, 1, k, length)


def mask_rows(mask: torch.Tensor, length: int) -> tuple[torch.Tensor, int, int]:
    """An attention mask as ``[Bm, Km, length]`` with its Bm (1: every sequence, or one per
    sequence) and Km (1: every query token, or one per query token): a mask of ``length``
    elements serves all; a 4-D mask [Bm, 1, Km, length] (HF's) has one row per sequence and per
    query token."""
    if mask.numel() == length:
        return mask.reshape(1, 1, length), 1, 1
    bm, km = mask.shape[0], mask.shape[-2]
    return mask.reshape(bm, km, length), bm, km


@semantic("attention")
def _attention(op: Op, env: Env) -> None:
    """Decode attention of each sequence b of the batch and each of its K query tokens: q [B,
    Hq, K, D] over its own cache rows k, v [B, Hkv, L, D]; a mask of L elements serves every
    sequence, a 4-D one [Bm, 1, Km, L] gives each sequence (Bm = B) and each query token (Km
    = K) its own row (:func:`mask_rows`). Without a mask (K = 1 only) rows [0, pos] attend."""
    info = env.g.tensors[op.outputs["out"]]
    kb, vb = env.read(op.inputs["k"]), env.read(op.inputs["v"])
    B, L = kb.shape[0], kb.shape[2]
    qshape = env.g.tensors[op.inputs["q"]].shape
    K = int(qshape[2]) if len(qshape) == 4 else 1
    if K > 1:   # K query tokens per sequence: the mask decides (causal among them and the cache)
        last = -1 if op.attrs.get("mask_kind", 0) == TOKEN_POSITIONS else 0   # mask_kind 3: rows up to pos[K - 1]
        _in_range(op, "attention position", int(env.read(op.inputs["pos"]).reshape(-1)[last]), L, Fault.ATTN_POS)
        qb = env.read(op.inputs["q"]).reshape(B, -1, K, kb.shape[-1])
        mask, kind = env.read(op.inputs["mask"]), op.attrs.get("mask_kind", 0)
        if kind == TOKEN_POSITIONS:   # the write positions: token k attends rows 0 .. pos[k]
            mask, kind = token_mask(mask, L), 1
        m, bm, km = mask_rows(mask, L)
        o = torch.stack([torch.stack([attend(qb[b, :, t], kb[b], vb[b], L, op.attrs["scale"],
                                             m[b % bm, t % km], kind, op.attrs.get("softcap", 0.0))
                                      for t in range(K)], 1) for b in range(B)])
        env.set(op.outputs["out"], o.to(info.dtype).reshape(info.shape))
        return
    qb = env.read(op.inputs["q"]).reshape(B, -1, kb.shape[-1])
    mask = env.read(op.inputs["mask"]) if "mask" in op.inputs else None
    # a mask decides over every cache row; without one the step attends rows [0, pos]
    length = L if mask is not None else \
        _in_range(op, "attention position", int(env.read(op.inputs["pos"]).reshape(-1)[0]), L, Fault.ATTN_POS) + 1
    if mask is not None:
        mask = mask.reshape(-1, L)
    o = torch.stack([attend(qb[b], kb[b], vb[b], length, op.attrs["scale"],
                            None if mask is None else mask[b % mask.shape[0]], op.attrs.get("mask_kind", 0),
                            op.attrs.get("softcap", 0.0))
                     for b in range(B)])
    env.set(op.outputs["out"], o.to(info.dtype).reshape(info.shape))


@semantic("table_lookup")
def _table_lookup(op: Op, env: Env) -> None:
    info = env.g.tensors[op.outputs["out"]]
    table = env.read(op.inputs["table"])
    pos = _in_range(op, "position (table lookup)", int(env.read(op.inputs["pos"]).reshape(-1)[0]), table.shape[0], Fault.INDEX)
    env.set(op.outputs["out"], table[pos].reshape(info.shape).clone())


def default_scale(head_dim: int) -> float:
    """SDPA's default softmax scale, 1/sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)


def run_op(op: Op, env: Env) -> None:
    """Execute one op whole: ATen ops through PyTorch, semantic ops here, instruction kinds
    tile by tile with their own tiling into a single tile."""
    if op.kind.startswith(("aten.", "prims.", "fusec.")):
        run_aten(op, env)
    elif op.kind in SEMANTICS:
        SEMANTICS[op.kind](op, env)
    elif op.kind in WHOLE:
        WHOLE[op.kind](op, env)
    else:
        raise KeyError(f"{op.name}: no semantics for kind {op.kind!r} (an instruction kind registers "
                       f"itself in semantics.WHOLE when fusec.instructions is imported)")


def execute(g, flat_args: list) -> list[torch.Tensor]:
    """Run a graph op by op on the CPU (the reference executor); returns the outputs."""
    env = Env(g, flat_args)
    for op in g.ops:
        run_op(op, env)
    return [env.read(t) for t in g.outputs]
