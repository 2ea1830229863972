"""Shared helpers for the example model files: build an HF Llama model, prefill, decode args.

Each example's ``build()`` returns ``(model, args, kwargs)`` for ONE decode step of a
``LlamaForCausalLM`` whose static KV cache already holds a short prefill, which is what
``fusec compile`` and the benchmarks expect. The helpers live here so the examples stay short;
the examples import this module by inserting their own folder on ``sys.path``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily make ``dtype`` torch's default floating dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def _skip_torch_default_init() -> Iterator[None]:
    """Skip torch's own ``reset_parameters`` of Linear and Embedding during construction.

    Hugging Face's ``post_init`` overwrites every weight with its own init (normal, std
    ``initializer_range``; ones for norms), so torch's kaiming init is wasted work: about half
    the construction time of a 1B model on a small CPU.
    """
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None  # type: ignore[method-assign]
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn  # type: ignore[method-assign]


def make_model(config: Any, dtype: torch.dtype, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """Create a randomly initialised causal LM of ``config``'s family (``AutoModelForCausalLM``:
    ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` ...) in ``dtype`` on ``device``, in eval mode.

    The model is built directly in ``dtype`` (never materialised in fp32 first) and directly
    on ``device`` with a fixed seed (the weights depend on the device's random generator), and
    its parameters do not require grad (a decode step is inference).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with _default_dtype(dtype), torch.device(device), _skip_torch_default_init():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def prefill_and_decode_args(
    model: nn.Module, max_cache_len: int, prefill_len: int, seed: int = 0
) -> tuple[tuple, dict[str, Any]]:
    """Run an eager prefill of ``prefill_len`` random tokens into a fresh ``StaticCache``.

    Returns ``(args, kwargs)`` for the next decode step: the greedy next token as
    ``input_ids`` of shape ``[1, 1]``, the filled cache as ``past_key_values``, and
    ``use_cache=True``. The prompt, the cache and the token are on the model's device.
    """
    from transformers import StaticCache

    config = model.config
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    prompt = torch.randint(0, config.vocab_size, (1, prefill_len), generator=gen).to(device)
    with torch.no_grad():
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
    next_token = out.logits[:, -1:].argmax(dim=-1)  # [1, 1]
    kwargs = {"input_ids": next_token, "past_key_values": cache, "use_cache": True}
    return (), kwargs


def decode_step(config: Any, dtype: torch.dtype, max_cache_len: int, prefill_len: int,
                device: str | torch.device = "cpu", seed: int = 0) -> tuple[nn.Module, tuple, dict[str, Any]]:
    """``(model, args, kwargs)`` for one decode step of a random model of ``config``
    (:func:`make_model`) after an eager prefill of ``prefill_len`` tokens into a
    ``max_cache_len`` StaticCache (:func:`prefill_and_decode_args`): what an example's
    ``build()`` returns."""
    model = make_model(config, dtype, seed=seed, device=device)
    args, kwargs = prefill_and_decode_args(model, max_cache_len, prefill_len, seed=seed)
    return model, args, kwargs
