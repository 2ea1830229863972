"""Custom ops that keep model-level structure visible through AOT autograd.

``fusec::sdpa`` stands in for ``torch.nn.functional.scaled_dot_product_attention`` during
capture, so that attention reaches the IR as one node on every device instead of the
device-specific decomposition that PyTorch would pick (math on the CPU, flash/efficient
kernels on CUDA). Its eager implementation is PyTorch's own SDPA, so running the captured
graph as-is gives exactly the model's results.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("fusec::sdpa", mutates_args=())
def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
         dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
         softcap: float = 0.0) -> torch.Tensor:
    """Scaled dot-product attention, PyTorch semantics (``F.scaled_dot_product_attention``), with
    Gemma-2's attention logit softcapping when ``softcap`` > 0: the scaled scores ``s`` become
    ``softcap * tanh(s / softcap)`` before the mask (HF ``Gemma2`` ``eager_attention_forward``;
    Gemma 2 report, section 2), computed as HF's eager attention does (scores in q's dtype, the
    softmax in fp32).

    Shapes: q [B, Hq, S, D], k/v [B, Hkv, L, D]; returns [B, Hq, S, D] in q's dtype.
    """
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa).contiguous()
    return softcapped_attention(q, k, v, attn_mask, is_causal, scale, softcap)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                         is_causal: bool, scale: float | None, softcap: float) -> torch.Tensor:
    """:func:`sdpa` with ``softcap`` > 0 (no dropout): HF's Gemma-2 eager attention, GQA by
    repeating the KV heads; a bool mask keeps True rows. Shapes as :func:`sdpa`'s."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    w = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    w = torch.tanh(w / softcap) * softcap
    if is_causal:
        w = w.masked_fill(~torch.ones(w.shape[-2:], dtype=torch.bool, device=w.device).tril(), float("-inf"))
    if attn_mask is not None:
        w = w.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else w + attn_mask
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v).contiguous()


@sdpa.register_fake
def _sdpa_fake(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap=0.0):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                  "enable_gqa": False}


def rewrite_sdpa(gm: torch.fx.GraphModule) -> int:
    """Replace SDPA calls in a dynamo FX graph by ``torch.ops.fusec.sdpa``; return the count."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            vals = dict(zip(_SDPA_ARGS, node.args))
            vals.update(node.kwargs)
            if "attn_mask" not in vals and "attention_mask" in vals:
                vals["attn_mask"] = vals.pop("attention_mask")
            full = [vals.get(k, _SDPA_DEFAULTS.get(k)) for k in _SDPA_ARGS]
            node.target = torch.ops.fusec.sdpa.default
            node.args = tuple(full)
            node.kwargs = {}
            n += 1
    gm.recompile()
    return n
