"""A hand-written static-cache Llama decode step in plain PyTorch (gpt-fast style).

The "strongest plain-PyTorch peer" of DESIGN.md section 6: one decode step of a Hugging Face
``LlamaForCausalLM`` written out by hand, meant to run under ``torch.compile`` (inductor) and
be replayed from a CUDA graph. It avoids what makes the HF graph slow at batch 1: no repeat of
the whole KV cache for grouped-query attention, no float mask of the full cache length, no
Python-side position bookkeeping (the position is a device tensor, ``input_pos``).

It owns no weights and no cache: every parameter is the HF model's own tensor (shared, never
copied, unless the opt-in ``fuse`` concatenates q/k/v and gate/up) and the K/V caches are the
``keys`` / ``values`` tensors of the HF ``StaticCache`` layers, so the step and the HF model
read and write the same memory. Numerics follow ``transformers.models.llama.modeling_llama``
(fp32 RMSNorm statistics, RoPE cos/sin computed in fp32 from the HF ``rotary_emb.inv_freq`` and
``attention_scaling`` then cast to the model dtype, rotate-half RoPE, SwiGLU MLP, tied or untied
LM head).

Attention defaults to two batched matmuls and an fp32 softmax ("math"), the fastest mode
measured: whole step on an H200 under inductor, CUDA graph, position 4095 (2026-11-29):
math 1.33 ms (1.33 at position 127 too), sdpa-expand 1.70 ms, sdpa-fold 1.95 ms.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: How the step attends over the static cache (see ``HandwrittenLlamaDecode``).
ATTENTION_MODES = ("math", "sdpa-fold", "sdpa-gqa", "sdpa-expand")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF ``LlamaRMSNorm``: statistics in fp32, scale by ``weight`` in the input dtype.

    Args:
        x: ``[..., hidden]`` activations (model dtype).
        weight: ``[hidden]`` norm weight (model dtype).
        eps: the config's ``rms_norm_eps``.
    """
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split in halves on the last axis (HF convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer(nn.Module):
    """One decoder layer's weights (the HF tensors themselves) and its K/V cache tensors.

    With ``fuse``, the q/k/v and the gate/up weights are also concatenated into new tensors
    ``fused_wqkv`` ``[q+k+v, hidden]`` and ``fused_w_gate_up`` ``[2 * ffn, hidden]`` (copies: one
    matmul each instead of three and two); the step then reads those instead of the HF ones.
    Not faster on the H200 (sdpa-fold attention, position 4095: 2.09 ms fused, 1.95 separate).
    """

    def __init__(self, hf_layer: nn.Module, keys: torch.Tensor, values: torch.Tensor,
                 fuse: bool = False) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.attn_norm = hf_layer.input_layernorm.weight
        self.mlp_norm = hf_layer.post_attention_layernorm.weight
        self.wq, self.wk, self.wv = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
        self.bq, self.bk, self.bv = attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias
        self.wo, self.bo = attn.o_proj.weight, attn.o_proj.bias
        self.w_gate, self.w_up, self.w_down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        self.b_gate, self.b_up, self.b_down = mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias
        self.fuse = fuse
        if fuse:
            def cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
                return None if ts[0] is None else torch.cat(ts, dim=0)
            self.register_buffer("fused_wqkv", cat(self.wq, self.wk, self.wv), persistent=False)
            self.register_buffer("fused_bqkv", cat(self.bq, self.bk, self.bv), persistent=False)
            self.register_buffer("fused_w_gate_up", cat(self.w_gate, self.w_up), persistent=False)
            self.register_buffer("fused_b_gate_up", cat(self.b_gate, self.b_up), persistent=False)
        # The cache is state shared with the HF StaticCache: a buffer (mutable, not a
        # parameter) that is not saved with the module.
        self.register_buffer("k_cache", keys, persistent=False)
        self.register_buffer("v_cache", values, persistent=False)


class HandwrittenLlamaDecode(nn.Module):
    """One batch-1 decode step of an HF ``LlamaForCausalLM`` over its ``StaticCache``.

    ``forward(input_ids, input_pos)`` embeds one token, runs every layer (RMSNorm, q/k/v
    projections, RoPE at ``input_pos``, K/V write into the static cache with ``index_copy_``,
    attention over the whole static cache with the boolean mask ``arange(max_len) <= input_pos``,
    output projection, RMSNorm, SwiGLU MLP, residuals), the final norm and the LM head.
    It does not advance any position counter: the caller owns ``input_pos`` (and the HF
    cache's ``cumulative_length`` is left alone).

    Args:
        hf_model: an HF ``LlamaForCausalLM`` (any device and float dtype) in eval mode.
        cache: an HF ``StaticCache`` whose layers are initialised (allocated by one HF forward
            call), batch 1, on the model's device and dtype.
        attention: how the one query token attends over the whole static cache (masked), and
            how grouped-query attention is handled. In every mode the ``n_heads`` query heads
            are ``n_kv_heads`` groups of ``n_heads // n_kv_heads`` (HF ``repeat_kv`` order).
            ``"math"`` (default): the group's queries are rows of one matrix per KV head:
            ``softmax(q K^T * scale + mask) V`` with two batched matmuls over the cache as it
            is (no repeat), softmax in fp32; parallel over the cache length.
            ``"sdpa-fold"``: the same grouping through ``F.scaled_dot_product_attention``.
            ``"sdpa-gqa"``: SDPA with ``enable_gqa=True``.
            ``"sdpa-expand"``: SDPA on K/V broadcast to ``n_heads`` with ``expand``.
        fuse: one q/k/v matmul and one gate/up matmul per layer, on concatenated COPIES of
            the HF weights (see ``_Layer``); off by default (the HF tensors are used as they are).
    """

    def __init__(self, hf_model: nn.Module, cache: Any, attention: str = "math", fuse: bool = False) -> None:
        super().__init__()
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, not {attention!r}")
        cfg = hf_model.config
        base = hf_model.model
        if len(cache.layers) != cfg.num_hidden_layers:
            raise ValueError(f"cache has {len(cache.layers)} layers, model {cfg.num_hidden_layers}")
        if not all(getattr(layer, "is_initialized", False) for layer in cache.layers):
            raise ValueError("StaticCache layers are not allocated yet: run one HF forward on it first")
        self.attention_mode = attention
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_len = cache.layers[0].keys.shape[2]
        self.tok_embeddings = base.embed_tokens.weight      # [vocab, hidden]
        self.norm = base.norm.weight                        # [hidden]
        self.lm_head = hf_model.lm_head.weight              # [vocab, hidden]; tied: the embedding
        self.layers = nn.ModuleList(
            _Layer(hf_layer, c.keys, c.values, fuse) for hf_layer, c in zip(base.layers, cache.layers))
        rotary = base.rotary_emb
        # fp32 [head_dim // 2], the llama3-scaled frequencies HF computed; a buffer shared with HF.
        self.register_buffer("inv_freq", rotary.inv_freq, persistent=False)
        self.attention_scaling = float(rotary.attention_scaling)

    def rope(self, input_pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[1, 1, 1, head_dim]`` in ``dtype`` for the position ``input_pos`` ``[1]``.

        As HF's ``LlamaRotaryEmbedding.forward``: angles and cos/sin in fp32 (times
        ``attention_scaling``), then cast to the activation dtype.
        """
        freqs = input_pos.float()[:, None] * self.inv_freq.float()[None, :]   # [1, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos.view(1, 1, 1, -1), sin.view(1, 1, 1, -1)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
        """Attention of one query token over the whole static cache (``self.attention_mode``).

        Args:
            q: ``[1, n_heads, 1, head_dim]`` (after RoPE).
            k_cache, v_cache: ``[1, n_kv_heads, max_len, head_dim]``.
            mask: ``[1, 1, 1, max_len]`` bool, True where the key position is ``<= input_pos``.
        Returns:
            ``[1, n_heads, 1, head_dim]``; query head ``h`` attends KV head
            ``h // (n_heads // n_kv_heads)`` (HF ``repeat_kv`` order).
        """
        group = self.n_heads // self.n_kv_heads
        mode = self.attention_mode
        if mode == "math":
            qg = q.view(1, self.n_kv_heads, group, self.head_dim)
            scores = torch.matmul(qg, k_cache.transpose(-1, -2)).float() * self.head_dim ** -0.5
            scores = scores.masked_fill(~mask, float("-inf"))              # [1, kv, group, max_len]
            p = torch.softmax(scores, dim=-1).to(q.dtype)
            return torch.matmul(p, v_cache).view(q.shape)
        if mode == "sdpa-fold":
            qg = q.view(1, self.n_kv_heads, group, self.head_dim)
            return F.scaled_dot_product_attention(qg, k_cache, v_cache, attn_mask=mask).view(q.shape)
        if mode == "sdpa-gqa":
            return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
        shape = (1, self.n_kv_heads, group, self.max_len, self.head_dim)
        k = k_cache[:, :, None].expand(shape).reshape(1, self.n_heads, self.max_len, self.head_dim)
        v = v_cache[:, :, None].expand(shape).reshape(1, self.n_heads, self.max_len, self.head_dim)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """One decode step.

        Args:
            input_ids: ``[1, 1]`` int64 token id.
            input_pos: ``[1]`` int64 position of that token (device tensor; 0-based, also the
                cache row written).
        Returns:
            logits ``[1, 1, vocab]`` in the model dtype. Side effect: row ``input_pos`` of every
            layer's K/V cache holds the new key/value.
        """
        x = F.embedding(input_ids, self.tok_embeddings)                     # [1, 1, hidden]
        cos, sin = self.rope(input_pos, x.dtype)
        mask = (torch.arange(self.max_len, device=x.device) <= input_pos).view(1, 1, 1, -1)
        hd = self.head_dim
        for layer in self.layers:
            h = rms_norm(x, layer.attn_norm, self.eps)
            if layer.fuse:
                nq, nkv = self.n_heads * hd, self.n_kv_heads * hd
                q, k, v = F.linear(h, layer.fused_wqkv, layer.fused_bqkv).split([nq, nkv, nkv], dim=-1)
            else:
                q = F.linear(h, layer.wq, layer.bq)
                k = F.linear(h, layer.wk, layer.bk)
                v = F.linear(h, layer.wv, layer.bv)
            q = q.view(1, 1, self.n_heads, hd).transpose(1, 2)
            k = k.view(1, 1, self.n_kv_heads, hd).transpose(1, 2)
            v = v.view(1, 1, self.n_kv_heads, hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            layer.k_cache.index_copy_(2, input_pos, k)
            layer.v_cache.index_copy_(2, input_pos, v)
            y = self.attention(q, layer.k_cache, layer.v_cache, mask)      # [1, n_heads, 1, hd]
            y = y.transpose(1, 2).reshape(1, 1, self.n_heads * hd)
            x = x + F.linear(y, layer.wo, layer.bo)
            h = rms_norm(x, layer.mlp_norm, self.eps)
            if layer.fuse:
                gate, up = F.linear(h, layer.fused_w_gate_up, layer.fused_b_gate_up).chunk(2, dim=-1)
            else:
                gate, up = F.linear(h, layer.w_gate, layer.b_gate), F.linear(h, layer.w_up, layer.b_up)
            x = x + F.linear(F.silu(gate) * up, layer.w_down, layer.b_down)
        x = rms_norm(x, self.norm, self.eps)
        return F.linear(x, self.lm_head)


def shares_weights(step: HandwrittenLlamaDecode, hf_model: nn.Module) -> bool:
    """True when every tensor of ``step`` is storage of ``hf_model`` (no copy).

    The K/V caches (the StaticCache's) and the ``fused_*`` concatenations (copies by design)
    are not counted.
    """
    hf_ptrs = {t.data_ptr() for t in list(hf_model.parameters()) + list(hf_model.buffers())}
    own = [t for name, t in list(step.named_parameters()) + list(step.named_buffers())
           if not name.endswith(("k_cache", "v_cache")) and ".fused_" not in name]
    return all(t.data_ptr() in hf_ptrs for t in own)
