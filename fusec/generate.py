"""``fusec.generate``: text generation for 1 to 16 prompts whose tokens stay on the device between steps.

:func:`generate` runs the prompts eagerly (the prefill), then every new token through one
compiled step, ``torch.compile(_DecodeStep(model), backend="fusec")``, whose graph holds the
decode step, the greedy choice of the next token (``argmax``, fused into the LM head's
instruction at batch 1) and the in-place write of that token into the ``[B, 1]`` device tensor
that the next step reads as its ``input_ids``. Sampling (Gumbel-max with temperature, top-k,
top-p) runs as torch ops on the device right after the step (the graph returns the logits):
top-p's sort and cumsum have no fusec instruction, and the generic single-tile instructions that
could hold temperature and top-k measured slower than torch's kernels (:data:`SAMPLE_IN_GRAPH`).

A batch of B > 1 prompts (left-padded, with their ``attention_mask``; or one padded prompt)
decodes through :class:`_BatchDecodeStep`, which also takes each sequence's position, the
attention mask over the cache's rows and each sequence's unfinished flag, all device tensors
(:class:`_Batch`): the step advances the positions and, past a sequence's end-of-sequence
token, writes the pad token instead of its choice (HF's ``unfinished_sequences``); the driver
sets the mask's column of the row each step writes with one device op before it. Batch 1
without padding keeps :class:`_DecodeStep`, whose only input besides the cache is the token.

No token goes back to the host to start the next step. The host learns the tokens one chunk
(:data:`CHUNK` steps) at a time, one chunk behind the device: after enqueueing chunk ``c`` it
waits for chunk ``c - 1``'s asynchronous device-to-host copy, hands it to the streamer and
looks for end-of-sequence tokens in it. On CUDA, after :data:`WARMUP` plain steps (compile),
the ``CHUNK`` steps of a chunk are captured once into a CUDA graph and replayed per chunk; if
the capture fails, one log line says so and the steps are launched in a plain Python loop
(same chunking, still no per-token host sync). On the CPU (the simulator target) the steps run
in a Python loop.
"""
from __future__ import annotations

import collections
import logging
import math
import time
from typing import Any

import torch

from fusec.errors import FusecError
from fusec.fallbacks import FallbackWatch
from fusec.fallbacks import warn as warn_fallback
from fusec.frontend import hf_rope
from fusec.frontend.precompiled import PrecompiledStep

log = logging.getLogger("fusec")

#: decode steps per chunk: per CUDA-graph replay and per host check (EOS, streamer)
CHUNK = 16
#: plain decode steps before the CUDA graph is captured (the first one compiles)
WARMUP = 2
#: the static KV cache's length is prompt + max_new_tokens rounded up to a multiple of this
#: (the cache's length is symbolic in the compiled step: one step serves every length)
CACHE_ALIGN = 64
#: sampling: select the token inside the compiled step (temperature, top-k, Gumbel-max argmax
#: as generic megakernel instructions) instead of as torch ops after it. Off: on an H200 with a
#: 128256-token vocabulary (bf16 tiny Llama, 160 tokens, CUDA graph) the generic single-tile
#: instructions measured 1.22 ms/token (temperature only) and 49 ms/token (top_k=50) against
#: 0.235 and 0.370 ms/token as torch ops (greedy: 0.145 ms/token, argmax fused into the LM head).
SAMPLE_IN_GRAPH = False
#: the decode step through :class:`fusec.frontend.precompiled.PrecompiledStep`: dynamo traces
#: the model once per model configuration and input shapes, and later processes load its graph
#: and guards from the artifact cache instead of tracing again (the plain ``torch.compile``
#: path when that fails, with one log line, or with the ``cache`` option off)
PRECOMPILE = True
#: the largest batch of prompts :func:`generate` takes (the batched kinds' ``max_rows``)
MAX_BATCH = 16


def _gumbel_(u: torch.Tensor) -> torch.Tensor:
    """Uniform samples in [0, 1) -> standard Gumbel samples ``-log(-log(u))``, in place."""
    return u.clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_().log_().neg_()


def _select(logits: torch.Tensor, gumbel: torch.Tensor | None, temperature: float,
            top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The next token of each sequence, int64 ``[B]``, from the last position's logits ``[B, V]``
    (row by row).

    ``gumbel`` None: greedy (``argmax``, first index among equal maxima). Otherwise ``gumbel``
    holds standard Gumbel samples ``[B, V]`` (:func:`_gumbel_`) and the token is a sample of
    ``softmax(logits / temperature)`` restricted to the top-k / top-p tokens (HF's
    ``TopKLogitsWarper`` and ``TopPLogitsWarper``, in that order), drawn with the Gumbel-max
    trick: ``argmax(logits / T + gumbel)``.
    """
    if gumbel is None:
        return logits.argmax(-1)
    x = logits.float() / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = torch.where(x < kth, float("-inf"), x)
    if top_p is not None and top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1)                       # ascending, as HF
        remove = sorted_x.softmax(-1).cumsum(-1) <= 1.0 - top_p
        remove[..., -1:] = False                                    # keep the best token
        x = x.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))
    return (x + gumbel).argmax(-1)


def _selection_in_graph(sample: bool, top_k: int | None, top_p: float | None) -> bool:
    """Whether the token is selected inside the compiled step (else by torch ops on the device
    after it): greedy always (the argmax fuses into the LM head); sampling with
    :data:`SAMPLE_IN_GRAPH`, and never with top-p, whose sort and cumsum have no fusec instruction."""
    return not sample or (SAMPLE_IN_GRAPH and top_p is None)


class _DecodeStep(torch.nn.Module):
    """One decode step that picks its next token on the device and feeds it back in place.

    ``forward(tokens, cache[, noise])``: ``tokens`` is the int64 ``[1, 1]`` device tensor of
    the current token; the step runs the model on it, selects the next token (see
    :func:`_select`; ``noise``: Gumbel samples ``[1, V]`` when sampling), writes it into
    ``tokens`` and returns it. With ``select_in_graph`` False (sampling, see
    :func:`_selection_in_graph`), it returns the last logits ``[1, V]`` instead and the caller
    selects and writes the token.
    """

    def __init__(self, model: torch.nn.Module, sample: bool, temperature: float, top_k: int | None,
                 select_in_graph: bool):
        super().__init__()
        self.model = model
        self.sample = sample
        self.temperature = float(temperature)
        self.top_k = top_k
        self.select_in_graph = select_in_graph

    def forward(self, tokens: torch.Tensor, cache: Any, noise: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.model(input_ids=tokens, past_key_values=cache, use_cache=True).logits[:, -1]
        if not self.select_in_graph:
            return logits
        nxt = _select(logits, noise if self.sample else None, self.temperature, self.top_k, None)
        tokens.copy_(nxt.view(1, 1))
        return nxt


def _finish(nxt: torch.Tensor, unfinished: torch.Tensor, eos: tuple[int, ...], pad: int) -> torch.Tensor:
    """HF's ``unfinished_sequences`` step (``GenerationMixin._sample``) on the device: a sequence
    that has finished gets ``pad`` instead of its token ``nxt`` (int64 ``[B]``), and a sequence
    whose token is one of ``eos`` is finished from now on (``unfinished``, int64 ``[B, 1]``, 1
    while unfinished, updated in place). Returns the tokens, int64 ``[B]``. Plain elementwise
    ops (no ``isin``), so that the compiled step holds them."""
    unf = unfinished.view(-1)
    nxt = nxt * unf + pad * (1 - unf)
    keep = unf
    for e in eos:
        keep = keep * (nxt != e).to(torch.int64)
    unfinished.copy_(keep.view(unfinished.shape))
    return nxt


class _BatchDecodeStep(torch.nn.Module):
    """One decode step of a batch of B sequences (left-padded prompts), fed back in place.

    ``forward(tokens, positions, mask, unfinished, cache[, noise])``:

    - ``tokens``: int64 ``[B, 1]``, each sequence's current token;
    - ``positions``: int64 ``[B, 1]``, each sequence's RoPE position (``position_ids``): the step
      adds 1 in place after the model read it;
    - ``mask``: the attention mask over the cache's L rows, either the complete bool mask
      ``[B, 1, 1, L]`` that SDPA reads (True: attend; the caller sets the current row's column
      before each step, :class:`_Batch`) or the int64 ``[B, L]`` padding mask from which HF
      builds the per-layer masks inside the step (for caches with sliding-window layers);
    - ``unfinished``: int64 ``[B, 1]``, 1 while a sequence has produced no end-of-sequence token
      (:func:`_finish`; untouched when there are no eos ids);
    - ``noise``: Gumbel samples ``[B, V]`` when sampling in the step.

    It runs the model on ``tokens``, selects each sequence's next token (:func:`_select`, row
    by row), replaces the tokens of finished sequences by ``pad`` (:func:`_finish`), writes them
    into ``tokens`` and returns them (``[B]``). With ``select_in_graph`` False it returns the
    last logits ``[B, V]`` instead; the caller selects, finishes and writes.
    """

    def __init__(self, model: torch.nn.Module, sample: bool, temperature: float, top_k: int | None,
                 select_in_graph: bool, eos: tuple[int, ...], pad: int):
        super().__init__()
        self.model = model
        self.sample = sample
        self.temperature = float(temperature)
        self.top_k = top_k
        self.select_in_graph = select_in_graph
        self.eos = tuple(eos)   # plain settings: part of the precompiled step's key
        self.pad = int(pad)
        self.position_ids = _takes(model, "position_ids")

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, unfinished: torch.Tensor,
                cache: Any, noise: torch.Tensor | None = None) -> torch.Tensor:
        if mask.dim() == 4:   # the mask spans the cache's rows: one length symbol for both
            torch._check(mask.shape[-1] == cache.layers[0].keys.shape[-2])
        pos = {"position_ids": positions} if self.position_ids else {}
        logits = self.model(input_ids=tokens, attention_mask=mask, past_key_values=cache, use_cache=True,
                            **pos).logits[:, -1]
        if self.position_ids:
            positions.add_(1)
        if not self.select_in_graph:
            return logits
        nxt = _select(logits, noise if self.sample else None, self.temperature, self.top_k, None)
        if self.eos:
            nxt = _finish(nxt, unfinished, self.eos, self.pad)
        tokens.copy_(nxt.view(tokens.shape))
        return nxt


class _Batch:
    """The device state of :class:`_BatchDecodeStep` for prompts ``[B, n]`` with their 0/1 mask
    ``[B, n]``, a cache of ``rows`` rows and prefill positions ``pos0`` [B, n] (:func:`_positions`).

    Attributes:
        positions: int64 ``[B, 1]``, the next token's position per sequence (the prompt's last
            position + 1, as HF's ``_update_model_kwargs_for_generation``); the step advances it.
        mask: with ``complete`` the bool ``[B, 1, 1, rows]`` mask: the prompt's mask, then False;
            :meth:`advance` sets the column of the row the next step writes (``col``, an int64
            ``[1]`` device counter) before each step, so a step attends to its own row and those
            before it, as HF's causal mask with the padding of generate()'s 2-D mask. Without
            ``complete``: int64 ``[B, rows]``, the prompt's mask, then 1 (HF's causal and
            sliding-window parts hide the later columns inside the step).
        unfinished: int64 ``[B, 1]`` ones (:func:`_finish`).
        eos, pad: the eos ids and the pad id.

    Every tensor's dim 0 is marked static (``torch._dynamo.mark_static``): another batch size is
    another trace at a fixed B, never a symbolic batch (which fusec does not compile as one step
    for every cache length); the mask's length dim is marked dynamic, as the cache's rows.
    """

    def __init__(self, mask: torch.Tensor, pos0: torch.Tensor, rows: int, complete: bool,
                 eos: tuple[int, ...], pad: int):
        b, n = mask.shape
        dev = mask.device
        self.positions = pos0[:, -1:] + 1
        self.complete = complete
        if complete:
            self.mask = torch.zeros(b, 1, 1, rows, dtype=torch.bool, device=dev)
            self.mask[:, 0, 0, :n] = mask.bool()
            self.col = torch.full((1,), n, dtype=torch.int64, device=dev)
        else:
            self.mask = torch.ones(b, rows, dtype=torch.int64, device=dev)
            self.mask[:, :n] = mask
            self.col = None
        torch._dynamo.maybe_mark_dynamic(self.mask, self.mask.dim() - 1)
        self.unfinished = torch.ones(b, 1, dtype=torch.int64, device=dev)
        self.eos, self.pad = tuple(eos), int(pad)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The step's inputs after the tokens: positions, mask, unfinished."""
        return self.positions, self.mask, self.unfinished

    def advance(self) -> None:
        """Before a step (complete mask): attend to the row it writes. Two device ops, no host read."""
        if self.col is not None:
            self.mask.index_fill_(-1, self.col, True)
            self.col.add_(1)


def _static_batch(*objs: Any) -> None:
    """Mark dim 0 (the batch) of the tensors of ``objs`` (tensors, and the K and V tensors of a
    cache's layers) static for dynamo (:class:`_Batch`)."""
    for x in objs:
        for t in (x,) if isinstance(x, torch.Tensor) else \
                [v for layer in getattr(x, "layers", ()) for v in vars(layer).values() if isinstance(v, torch.Tensor)]:
            if t.dim() and t.shape[0] > 1:
                torch._dynamo.mark_static(t, 0)


def _full_attention(model: torch.nn.Module, cache: Any) -> bool:
    """Whether every layer attends causally to the whole cache (no sliding window, no chunked
    attention): the cache has no sliding-window layers and the config's ``layer_types``, where
    it has them, are all ``"full_attention"``. Then a decode step's mask is the padding and the
    causal bound, which :class:`_Batch` keeps complete on the device."""
    types = getattr(getattr(model, "config", None), "layer_types", None) or ("full_attention",)
    return not host_counted(cache) and all(t == "full_attention" for t in types)


def _check_model(model: Any) -> torch.device:
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
    p = next(model.parameters(), None)
    if p is None:
        raise FusecError(f"fusec.generate: {type(model).__name__} has no parameters")
    return p.device


def _check_args(input_ids: Any, attention_mask: Any, max_new_tokens: Any, do_sample: bool, temperature: Any,
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
    mask = _check_mask(attention_mask, input_ids)
    if mask is None and batch > 1:
        mask = torch.ones_like(input_ids)
    return input_ids, mask


def _check_mask(attention_mask: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
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


def _takes(model: torch.nn.Module, name: str) -> bool:
    """Whether the model's ``forward`` has a parameter ``name`` (HF's generate() passes
    ``position_ids`` only to a forward that has it)."""
    import inspect
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _last_logits_only(model: torch.nn.Module) -> dict[str, int]:
    """``{"logits_to_keep": 1}`` where the model's forward takes it (HF's causal LMs): the prefill
    computes the LM head for the last position only, not a ``[prompt_len, vocab]`` matrix
    (770 MB in bf16 for a 3000-token Llama-3 prompt, allocated anew at each new length)."""
    return {"logits_to_keep": 1} if _takes(model, "logits_to_keep") else {}


def _prefill_attention(cuda: bool) -> Any:
    """The context the eager prefill runs in: on CUDA, PyTorch's SDPA may use every backend but
    cuDNN's (``torch.nn.attention.sdpa_kernel``; flash, memory-efficient, math), elsewhere no
    change. cuDNN's attention builds an execution plan at the first call of each new shape: on
    the H200 machine (torch 2.11, Llama-3.2-1B bf16, 2026-12-03) a prompt length the process had
    not seen cost 0.11 s of prefill instead of 0.024 s, 70 ms of it in
    ``_cudnn_attention_forward``, so every new prompt length of a chat paid it. The prefill's
    masked attention then runs on the memory-efficient kernel, which has no per-shape setup.
    The decode steps are fusec's kernel either way."""
    import contextlib
    if not cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _eos_ids(model: torch.nn.Module, eos_token_id: Any) -> list[int]:
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


class _StepCache(dict):
    """The compiled decode steps kept on a model; copies and pickles of the model start empty."""

    def __deepcopy__(self, memo: dict) -> "_StepCache":
        return _StepCache()

    def __reduce__(self) -> tuple:
        return (_StepCache, ())


def host_counted(cache: Any) -> bool:
    """Whether ``cache`` has layers that count positions in a Python ``int`` (HF's
    ``StaticSlidingWindowLayer``: Mistral with a sliding window, Gemma-2, Gemma-3, StarCoder2). Their decode
    step takes that integer each call (fusec.frontend.host_scalars), so it can be neither replayed
    from a CUDA graph (the count would stay at its captured value) nor precompiled (dynamo guards
    on the value)."""
    return any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ()))


def _compiled_step(model: torch.nn.Module, sample: bool, temperature: float, top_k: int | None,
                   select_in_graph: bool, options: dict[str, Any], precompile: bool = True,
                   batch: tuple[tuple[int, ...], int] | None = None) -> Any:
    """``_DecodeStep(...)`` compiled with fusec, kept on the model per selection settings and
    options so that a second call reuses it: precompiled (:data:`PRECOMPILE` and
    ``precompile``) or plain ``torch.compile(..., backend="fusec", options=options)``.
    ``batch``: ``(eos ids, pad id)`` for the masked step of a batch, :class:`_BatchDecodeStep`
    (one per settings; each batch size its own trace: the step's guards hold the shapes)."""
    key = (sample, float(temperature) if sample else None, top_k if sample else None, select_in_graph,
           repr(sorted(options.items())), precompile) + (() if batch is None else ("batch", *batch))
    steps = model.__dict__.get("_fusec_generate_steps")
    if steps is None:
        steps = _StepCache()
        object.__setattr__(model, "_fusec_generate_steps", steps)   # not a submodule: no state_dict entry
    if key not in steps:
        wrapper = _DecodeStep(model, sample, temperature, top_k, select_in_graph) if batch is None else \
            _BatchDecodeStep(model, sample, temperature, top_k, select_in_graph, *batch)
        steps[key] = PrecompiledStep(wrapper, model, options) if PRECOMPILE and precompile else \
            torch.compile(wrapper, backend="fusec", options=options)
    return steps[key]


class _Decoder:
    """The decode loop's device state and its two ways of running a chunk of steps.

    ``tokens`` is int64 ``[B, 1]``; ``batch`` the masked step's other device state
    (:class:`_Batch`, :class:`_BatchDecodeStep`), None for the batch-1 step
    (:class:`_DecodeStep`). ``out`` is int64 ``[max_new_tokens, B]``: row ``k`` the ``k``-th
    new token of every sequence."""

    def __init__(self, step: Any, tokens: torch.Tensor, cache: Any, sample: bool, select_in_graph: bool,
                 temperature: float, top_k: int | None, top_p: float | None, vocab: int,
                 generator: torch.Generator | None, out: torch.Tensor, batch: "_Batch | None" = None):
        self.step, self.tokens, self.cache = step, tokens, cache
        self.sample, self.select_in_graph = sample, select_in_graph
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = generator
        self.out = out                        # [max_new_tokens, B] int64 on the device
        self.batch = batch
        self.args = (tokens,) if batch is None else (tokens, *batch.inputs())
        dev, rows = tokens.device, tokens.shape[0]
        # Gumbel noise: a [CHUNK, B, V] block drawn once per chunk (graph and plain paths draw
        # the same numbers); row j is step j's. The compiled step reads it from one [B, V]
        # input of fixed address (the kernel's pointer table is not rewritten inside a graph).
        self.noise_all = torch.zeros(CHUNK, rows, vocab, dtype=torch.float32, device=dev) if sample else None
        self.noise = torch.zeros(rows, vocab, dtype=torch.float32, device=dev) \
            if sample and select_in_graph else None
        if batch is not None:
            _static_batch(tokens, *batch.inputs(), cache, *(() if self.noise is None else (self.noise,)))
        self.graph: Any = None
        self.graph_out: torch.Tensor | None = None

    def draw(self) -> None:
        """Fill this chunk's noise block (a few device kernels; nothing when greedy)."""
        if self.sample:
            _gumbel_(self.noise_all.uniform_(generator=self.generator))

    def one(self, j: int) -> None:
        """Decode step ``j`` of the chunk: ``tokens`` holds the new tokens afterwards."""
        if self.batch is not None:
            self.batch.advance()
        if not self.sample:
            self.step(*self.args, self.cache)
        elif self.select_in_graph:
            self.noise.copy_(self.noise_all[j])
            self.step(*self.args, self.cache, self.noise)
        else:
            logits = self.step(*self.args, self.cache)
            nxt = _select(logits, self.noise_all[j], self.temperature, self.top_k, self.top_p)
            if self.batch is not None and self.batch.eos:
                nxt = _finish(nxt, self.batch.unfinished, self.batch.eos, self.batch.pad)
            self.tokens.copy_(nxt.view(self.tokens.shape))

    def plain(self, pos: int, n: int) -> None:
        """``n`` steps launched one by one; step ``k``'s tokens go to ``out[pos + k]`` (device copy)."""
        self.draw()
        for j in range(n):
            self.one(j)
            self.out[pos + j].copy_(self.tokens.view(-1))

    def capture(self) -> bool:
        """Capture ``CHUNK`` steps (and their token copies into a [CHUNK, B] buffer) into a CUDA
        graph. False, with one log line, if the capture failed."""
        buf = torch.zeros(CHUNK, self.tokens.shape[0], dtype=torch.int64, device=self.tokens.device)
        g = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                for j in range(CHUNK):
                    self.one(j)
                    buf[j].copy_(self.tokens.view(-1))
        except Exception as e:   # the step's launch path is not capturable (yet): plain launches
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            log.warning("fusec.generate: capturing %d decode steps in a CUDA graph failed (%s: %s); "
                        "launching the steps one by one", CHUNK, type(e).__name__, first[:200])
            try:
                torch.cuda.synchronize()
            except Exception:   # noqa: BLE001 - a sticky error surfaces at the next step anyway
                pass
            return False
        self.graph, self.graph_out = g, buf
        return True

    def replay(self, pos: int) -> None:
        """``CHUNK`` steps from the captured graph; tokens to ``out[pos:pos + CHUNK]``."""
        self.draw()
        self.graph.replay()
        self.out[pos:pos + CHUNK].copy_(self.graph_out)


def _pad_id(model: torch.nn.Module, pad_token_id: int | None, eos: list[int]) -> int:
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


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """The prefill's ``position_ids`` [B, n] of left-padded prompts, as HF's generate()
    (``GenerationMixin._prepare_position_ids_for_generation``, transformers 5.17): the mask's
    cumulative sum minus 1, the padding's positions 0."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def generate(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *,
             attention_mask: torch.Tensor | None = None, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None, streamer: Any = None,
             options: dict[str, Any] | None = None, generator: torch.Generator | None = None,
             prompt_lookup_num_tokens: int | None = None) -> torch.Tensor:
    """Generate up to ``max_new_tokens`` tokens after each of ``input_ids``' prompts (a batch of
    1 to :data:`MAX_BATCH`), each decode step one fusec megakernel launch for the whole batch,
    with no token returning to the host between steps.

    Args:
        model: a Hugging Face causal LM (``...ForCausalLM``) on the CPU (simulator target) or CUDA.
        input_ids: the prompts, int64 ``[B, prompt_len]`` (or ``[prompt_len]``: B = 1), B <= 16;
            prompts of different lengths left-padded (a tokenizer with ``padding_side="left"``).
        max_new_tokens: at most this many new tokens per sequence (>= 1).
        attention_mask: 0/1 ``[B, prompt_len]`` (int or bool), 0 at padding; None: all ones. The
            prefill reads it with HF's ``position_ids`` (its cumulative sum minus 1, 0 at
            padding); each decode step reads it over the cache's length (1 for every new
            column) with each sequence's position. A mask that ends in 0 (right padding) logs
            a warning, as HF does. At B = 1 an all-ones mask is no mask (the batch-1 step).
        do_sample: sample (Gumbel-max over ``softmax(logits / temperature)``) instead of greedy.
        temperature, top_k, top_p: sampling settings, as HF's (``top_k`` 0 or None and
            ``top_p`` None or 1.0: no filtering), per sequence; ignored when greedy.
        eos_token_id: an int or a list of ints; None: ``model.generation_config.eos_token_id``
            (as HF); ``[]``: never stop. B = 1: generation stops after the first of them, which
            is included. B > 1 (HF's ``unfinished_sequences``): a sequence's tokens after its
            first eos are ``pad_token_id``, and generation stops once every sequence has one.
        pad_token_id: the token of a finished sequence (B > 1); None: the generation config's,
            else the first eos id (as HF).
        streamer: an object with ``put(tensor)`` and ``end()`` (transformers' ``TextStreamer``),
            B = 1 only (as HF): ``put`` gets the prompt, then the new tokens one chunk at a time
            (CPU tensors).
        options: fusec options for the decode step (:class:`fusec.config.Options`);
            ``check_watchdog`` defaults to False here (it would read the GPU's status after
            every step).
        generator: a ``torch.Generator`` on the model's device for sampling (None: torch's default).
        prompt_lookup_num_tokens: N, greedy only: prompt-lookup decoding (transformers' argument of
            that name), each step verifying N tokens drafted from earlier in the text, 1 to
            ``MAX_QUERY_TOKENS - 1`` (:mod:`fusec.prompt_lookup`); the output is greedy's.
            One prompt without padding only (B = 1).

    Returns:
        int64 ``[B, prompt_len + n_new]`` on the model's device: the prompts as given, then the
        new tokens (``n_new``: ``max_new_tokens``, or fewer where every sequence met an eos).

    Raises:
        FusecError: an invalid argument or option (a batch over 16, a mask of another shape, a
            streamer or prompt lookup with B > 1, ...).

    B = 1 without a mask (or with an all-ones one) compiles :class:`_DecodeStep`, whose only
    input besides the cache is the token. A batch (or a padded prompt) compiles
    :class:`_BatchDecodeStep`: its inputs are the tokens, the positions, the mask over the
    cache's rows and each sequence's unfinished flag, device tensors (:class:`_Batch`: the step
    advances the positions in place, one device op before each step sets the mask's column of
    the row it writes); greedy output equals HF ``generate(input_ids, attention_mask=...,
    do_sample=False)``'s token for token (tests/test_generate_batch.py).
    """
    from transformers import StaticCache

    from fusec.config import Options

    device = _check_model(model)
    input_ids, mask = _check_args(input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p,
                                  pad_token_id, streamer, generator, options, device)
    opts = {"check_watchdog": False, **(options or {})}
    Options.from_dict(opts)   # an invalid option fails now, before any work
    eos = _eos_ids(model, eos_token_id)
    pad = _pad_id(model, pad_token_id, eos)
    sample = bool(do_sample)
    if prompt_lookup_num_tokens is not None:
        from fusec import prompt_lookup
        if mask is not None:
            raise FusecError(f"fusec.generate: prompt_lookup_num_tokens takes one prompt without padding (batch 1): "
                             f"input_ids has shape {tuple(input_ids.shape)}"
                             + (", attention_mask has zeros" if input_ids.shape[0] == 1 else ""))
        num = prompt_lookup.check_num(prompt_lookup_num_tokens, sample)
        return prompt_lookup.generate(model, input_ids, max_new_tokens, num, eos, streamer, opts)[0]
    if sample:
        top_k = top_k or None
        top_p = None if top_p is None or float(top_p) >= 1.0 else float(top_p)
    else:
        top_k = top_p = None
    select_in_graph = _selection_in_graph(sample, top_k, top_p)
    cuda = device.type == "cuda"
    rows, prompt_len = input_ids.shape
    max_len = -(-(prompt_len + max_new_tokens) // CACHE_ALIGN) * CACHE_ALIGN
    if streamer is not None:
        streamer.put(input_ids.cpu())

    t_start = time.perf_counter()
    with torch.no_grad():
        # prefill, eagerly: the first new token
        cache = StaticCache(config=model.config, max_cache_len=max_len)
        extra: dict[str, Any] = {}
        if mask is not None:   # left-padded prompts: HF's position ids, the padding masked out
            pos0 = _positions(mask)
            extra["attention_mask"] = mask
            if _takes(model, "position_ids"):
                extra["position_ids"] = pos0
        with _prefill_attention(cuda):
            logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True,
                           **extra, **_last_logits_only(model)).logits[:, -1]
        out = torch.empty(max_new_tokens, rows, dtype=torch.int64, device=device)
        tokens = torch.empty(rows, 1, dtype=torch.int64, device=device)
        # the masked step's device state (advanced by device ops only)
        batch = None if mask is None else _Batch(mask, pos0, max_len, _full_attention(model, cache), tuple(eos), pad)
        noise0 = _gumbel_(torch.rand(rows, logits.shape[-1], generator=generator, device=device)) if sample else None
        first = _select(logits, noise0, temperature, top_k, top_p)
        if batch is not None and eos:
            first = _finish(first, batch.unfinished, batch.eos, pad)
        tokens.copy_(first.view(rows, 1))
        out[0].copy_(first.view(rows))

        host = torch.empty(max_new_tokens, rows, dtype=torch.int64, pin_memory=cuda)
        pending: collections.deque = collections.deque()   # (start, n, event) copied or in flight
        eos_t = torch.tensor(eos, dtype=torch.int64)
        done: list[int | None] = [None] * rows   # each sequence's first eos (its index in out)

        def enqueue_host(start: int, n: int) -> None:
            host[start:start + n].copy_(out[start:start + n], non_blocking=cuda)
            ev = None
            if cuda:
                ev = torch.cuda.Event()
                ev.record()
            pending.append((start, n, ev))

        def consume() -> int | None:
            """Take the oldest chunk on the host: stream it; the output's length once every
            sequence has met an eos (the step of the last one's first eos, included)."""
            start, n, ev = pending.popleft()
            if ev is not None:
                ev.synchronize()
            chunk = host[start:start + n]
            end = None
            if eos:
                hits = torch.isin(chunk, eos_t)
                for b in range(rows):
                    if done[b] is None:
                        where = hits[:, b].nonzero()
                        if len(where):
                            done[b] = start + int(where[0, 0])
                if all(d is not None for d in done):
                    end = max(done) + 1
            if streamer is not None:
                streamer.put(chunk[:n if end is None else end - start, 0].clone())
            return end

        enqueue_host(0, 1)
        end: int | None = None
        pos = 1
        dec = None
        while pos < max_new_tokens and end is None:
            if dec is None:
                counted = host_counted(cache)
                if not counted:
                    from fusec.frontend.static_cache import length_symbolic
                    length_symbolic(cache)
                if counted:
                    log.info("fusec.generate: the cache's sliding-window layers count positions in Python; "
                             "each step is launched on its own (no CUDA graph, no precompiled step)")
                hf_rope.dynamic_state_as_tensors(model)   # dynamic NTK: one compile, not two
                step = _compiled_step(model, sample, temperature, top_k, select_in_graph, opts,
                                      precompile=not counted, batch=None if batch is None else (batch.eos, pad))
                dec = _Decoder(step, tokens, cache, sample, select_in_graph, temperature, top_k, top_p,
                               logits.shape[-1], generator, out, batch)
                n = min(WARMUP if cuda else CHUNK, max_new_tokens - pos)
                t_step = time.perf_counter()
                with FallbackWatch() as w:
                    dec.plain(pos, n)      # the first call compiles
                if w.compiled:   # where a call that compiled or loaded its step spent its host time
                    log.info("fusec.generate: prefill launched in %.2f s, the decode step compiled or loaded "
                             "and %d steps launched in %.2f s (host wall time)", t_step - t_start, n,
                             time.perf_counter() - t_step)
                if w.fallbacks:
                    warn_fallback("fusec.generate: the decode step did not compile with fusec (%s); "
                                  "generating with the fallback (correct, slower)", w.fallbacks[0])
                if cuda and not counted and max_new_tokens - pos - n >= CHUNK:
                    dec.capture()
            else:
                n = min(CHUNK, max_new_tokens - pos)
                if n == CHUNK and dec.graph is not None:
                    dec.replay(pos)
                else:
                    dec.plain(pos, n)
            enqueue_host(pos, n)
            pos += n
            while len(pending) > 1 and end is None:   # one chunk behind the device
                end = consume()
        while pending and end is None:
            end = consume()
        pending.clear()
        if cuda:
            torch.cuda.current_stream(device).synchronize()
    if streamer is not None:
        streamer.end()
    n_new = max_new_tokens if end is None else end
    log.info("fusec.generate: %d new tokens (%s), %s", n_new, "eos" if end is not None else "max_new_tokens",
             "chunks of %d steps replayed from a CUDA graph" % CHUNK if dec is not None and dec.graph is not None
             else "steps launched one by one")
    return torch.cat([input_ids, out[:n_new].t()], dim=1)


class _CallableModule(type(collections)):
    """``fusec.generate`` is this module's function, but importing the submodule
    (``from fusec.generate import ...``) binds the module to the package attribute of the same
    name: calling the module calls the function, so ``fusec.generate(...)`` works either way."""

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return generate(*args, **kwargs)


import sys as _sys  # noqa: E402

_sys.modules[__name__].__class__ = _CallableModule
