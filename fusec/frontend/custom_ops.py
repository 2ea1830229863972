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
         dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """Scaled dot-product attention, PyTorch semantics (``F.scaled_dot_product_attention``).

    Shapes: q [B, Hq, S, D], k/v [B, Hkv, L, D]; returns [B, Hq, S, D] in q's dtype.
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale,
                                          enable_gqa=enable_gqa).contiguous()


@sdpa.register_fake
def _sdpa_fake(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
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
