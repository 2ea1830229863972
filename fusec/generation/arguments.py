"""``fusec.generate``'s arguments, checked before any work (each error names the argument and
what it must be), and the special tokens it derives from them and the model (eos, pad)."""
from __future__ import annotations

import logging
import math
from typing import Any

import torch

from fusec.config import MAX_CACHE_LEN
from fusec.errors import FusecError

log = logging.getLogger("fusec")

#: the largest batch of prompts ``fusec.generate`` takes (the batched kinds' ``max_rows``)
MAX_BATCH = 16


def check_model(model: Any) -> torch.device:
    """The device of ``model``'s parameters, after checking that it is a transformers causal LM
    that ``fusec.generate`` can run: a ``torch.nn.Module`` with a ``PretrainedConfig``, decoder
    only, with an LM head, whose class does not declare ``_can_compile_fullgraph = False``.

    Raises:
        FusecError: naming what the model is not.
    """
    if not isinstance(model, torch.nn.Module):
        raise FusecError(f"fusec.generate: model must be a Hugging Face causal LM (torch.nn.Module), "
                         f"got {type(model).__name__}")
    cfg = getattr(model, "config", None)
    try:
        from transformers import PretrainedConfig
    except ImportError:   # pragma: no cover - transformers is a requirement
        PretrainedConfig = object
    if not isinstance(cfg, PretrainedConfig):
        raise FusecError(f"fusec.generate: {type(model).__name__} has no Hugging Face config "
                         "(model.config): pass a transformers causal LM (e.g. LlamaForCausalLM)")
    if getattr(cfg, "is_encoder_decoder", False):
        raise FusecError(f"fusec.generate: {type(model).__name__} is an encoder-decoder model; "
                         "only decoder-only causal LMs are supported")
    can = getattr(model, "can_generate", None)
    if not callable(can) or not can():
        raise FusecError(f"fusec.generate: {type(model).__name__} is not a causal LM that can generate "
                         "(it has no LM head: use the ...ForCausalLM class)")
    owner = next((c for c in type(model).__mro__ if "_can_compile_fullgraph" in vars(c)), None)
    if owner is not None and owner.__name__ != "PreTrainedModel" and vars(owner)["_can_compile_fullgraph"] is False:
        # the model's authors say so (GPT-Neo: its local-attention layers need a sliding cache,
        # and a StaticCache gives other tokens than generate()'s own cache); PreTrainedModel's
        # default False is no statement about the model
        raise FusecError(f"fusec.generate: transformers marks {type(model).__name__} ({owner.__name__}) as not "
                         "compilable with a static "
                         "cache (_can_compile_fullgraph = False in its class), and fusec.generate runs every "
                         "model on a StaticCache, whose tokens may then differ from model.generate()'s: use "
                         "model.generate()")
    p = next(model.parameters(), None)
    if p is None:
        raise FusecError(f"fusec.generate: {type(model).__name__} has no parameters")
    return p.device


def check_args(input_ids: Any, attention_mask: Any, max_new_tokens: Any, do_sample: bool, temperature: Any,
                top_k: Any, top_p: Any, pad_token_id: Any, streamer: Any, generator: Any, options: Any,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prompts as int64 ``[B, n]`` on ``device`` and their mask (int64 ``[B, n]`` on
    ``device``; None at batch 1 when it is absent or all ones: the batch-1 step, which takes no
    mask), after checking every argument. At B > 1 without ``attention_mask``: all ones.

    Raises:
        FusecError: the first invalid argument, named with what it must be.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        got = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise FusecError(f"fusec.generate: input_ids must be an int64 (or int32) tensor of token ids, got {got}")
    if input_ids.dim() == 1:
        input_ids = input_ids.view(1, -1)
    if input_ids.dim() != 2:
        raise FusecError(f"fusec.generate: input_ids has shape {tuple(input_ids.shape)}, "
                         "expected [batch, prompt_len] (or [prompt_len])")
    batch = input_ids.shape[0]
    if not 1 <= batch <= MAX_BATCH:
        raise FusecError(f"fusec.generate: a batch of {batch} prompts (input_ids {tuple(input_ids.shape)}): "
                         f"the batch must be 1 to {MAX_BATCH}")
    if input_ids.shape[1] < 1:
        raise FusecError(f"fusec.generate: the prompt is empty (input_ids has shape {tuple(input_ids.shape)})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise FusecError(f"fusec.generate: max_new_tokens={max_new_tokens!r} must be an int >= 1")
    if input_ids.shape[1] + max_new_tokens > MAX_CACHE_LEN:   # the static cache spans the whole generation
        raise FusecError(f"fusec.generate: a prompt of {input_ids.shape[1]} tokens and max_new_tokens={max_new_tokens} "
                         f"need a KV cache of {input_ids.shape[1] + max_new_tokens} rows (one static cache for the "
                         f"whole generation), longer than fusec's longest, {MAX_CACHE_LEN} rows "
                         f"(fusec.config.MAX_CACHE_LEN): pass max_new_tokens <= {MAX_CACHE_LEN - input_ids.shape[1]}")
    if do_sample:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not math.isfinite(temperature) or temperature <= 0:
            raise FusecError(f"fusec.generate: temperature={temperature!r} must be a number > 0 when sampling")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            raise FusecError(f"fusec.generate: top_k={top_k!r} must be None or an int >= 1 (0: no top-k)")
        if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                                  or not 0.0 < top_p <= 1.0):
            raise FusecError(f"fusec.generate: top_p={top_p!r} must be None or in (0, 1]")
        if generator is not None:
            if not isinstance(generator, torch.Generator):
                raise FusecError(f"fusec.generate: generator must be a torch.Generator, got {type(generator).__name__}")
            if generator.device.type != device.type:
                raise FusecError(f"fusec.generate: the generator is on {generator.device}, the model on {device}: "
                                 f"create it with torch.Generator(device={str(device)!r})")
    elif temperature not in (None, 1.0) or top_k not in (None, 0) or top_p not in (None, 1.0):
        log.warning("fusec.generate: temperature / top_k / top_p are given but do_sample is False: greedy "
                    "decoding ignores them (pass do_sample=True to sample)")
    if pad_token_id is not None and (isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int)):
        raise FusecError(f"fusec.generate: pad_token_id={pad_token_id!r} must be an int or None")
    if streamer is not None and not all(callable(getattr(streamer, m, None)) for m in ("put", "end")):
        raise FusecError("fusec.generate: streamer must have put(tensor) and end() (transformers' TextStreamer API)")
    if streamer is not None and batch > 1:
        raise FusecError(f"fusec.generate: a streamer takes batch 1 only, as HF generate()'s: input_ids has "
                         f"{batch} prompts (generate the batch without a streamer)")
    if options is not None and not isinstance(options, dict):
        raise FusecError(f"fusec.generate: options must be a dict of fusec options, got {type(options).__name__}")
    input_ids = input_ids.to(device=device, dtype=torch.int64)
    mask = check_mask(attention_mask, input_ids)
    if mask is None and batch > 1:
        mask = torch.ones_like(input_ids)
    return input_ids, mask


def check_token_ids(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    """Every prompt id indexes a row of the model's input embedding (``[0, rows)``), as eager's
    ``torch.nn.functional.embedding`` requires (it raises ``IndexError`` from deep inside the
    prefill). One host read of the ids' min and max.

    Raises:
        FusecError: an id out of range, with its batch row, position and the range."""
    try:
        rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    except (AttributeError, NotImplementedError):   # a model without the HF accessor: eager decides
        rows = None
    if not isinstance(rows, int) or input_ids.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(input_ids))
    if lo >= 0 and hi < rows:
        return
    bad = ((input_ids < 0) | (input_ids >= rows)).nonzero()[0].tolist()
    value = int(input_ids[bad[0], bad[1]])
    raise FusecError(f"fusec.generate: input_ids[{bad[0]}, {bad[1]}] = {value} is not a token id of this model: "
                     f"its input embedding has {rows} rows, ids must be in [0, {rows})")


def check_mask(attention_mask: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
    """``attention_mask`` as int64 on the prompts' device, checked against ``input_ids`` [B, n];
    None when absent, or all ones at batch 1. One host read of the mask (before generation).

    Raises:
        FusecError: not a tensor of the prompts' shape, a value other than 0 and 1, a row of zeros.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.is_floating_point() \
            or attention_mask.is_complex():
        got = attention_mask.dtype if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise FusecError(f"fusec.generate: attention_mask must be an integer or bool tensor of 0 and 1, got {got}")
    mask = attention_mask.view(1, -1) if attention_mask.dim() == 1 else attention_mask
    if tuple(mask.shape) != tuple(input_ids.shape):
        raise FusecError(f"fusec.generate: attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                         f"{tuple(input_ids.shape)}: they must be equal (one 0/1 per prompt token)")
    mask = mask.to(device=input_ids.device, dtype=torch.int64)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise FusecError("fusec.generate: attention_mask must hold only 0 (padding) and 1 (a prompt token)")
    empty = (mask.sum(-1) == 0).nonzero().view(-1).tolist()
    if empty:
        raise FusecError(f"fusec.generate: attention_mask row {empty[0]} is all zeros (an empty prompt)")
    if bool((mask[:, -1] == 0).any()):   # as HF's generate(): a warning, and generation goes on
        log.warning("fusec.generate: right-padding was detected in attention_mask (a row ends in 0): a decoder-only "
                    "model needs prompts padded on the left (a tokenizer with padding_side='left')")
    if mask.shape[0] == 1 and bool(mask.all()):
        return None
    return mask.contiguous()


def eos_ids(model: torch.nn.Module, eos_token_id: Any) -> list[int]:
    """End-of-sequence ids: the argument, else the model's generation_config's (as HF)."""
    if eos_token_id is None:
        gc = getattr(model, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.flatten().tolist()
    ids = [eos_token_id] if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool) else eos_token_id
    try:
        ids = list(ids)
    except TypeError:
        ids = None
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise FusecError(f"fusec.generate: eos_token_id={eos_token_id!r} must be an int, a list of ints or None")
    return ids


def pad_id(model: torch.nn.Module, pad_token_id: int | None, eos: list[int]) -> int:
    """The token of a finished sequence: the argument, else the generation config's
    ``pad_token_id``, else the first eos id (HF's ``_prepare_special_tokens`` falls back so),
    else 0 (never used: without eos ids no sequence finishes)."""
    if pad_token_id is None:
        gc = getattr(model, "generation_config", None)
        pad_token_id = getattr(gc, "pad_token_id", None) if gc is not None else None
        if isinstance(pad_token_id, torch.Tensor):
            pad_token_id = int(pad_token_id.flatten()[0])
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    return int(pad_token_id)
