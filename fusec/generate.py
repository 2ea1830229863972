"""``fusec.generate``: text generation for 1 to 16 prompts whose tokens stay on the device between steps.

:func:`generate` runs the prompts eagerly (the prefill), then every new token through one
compiled step, ``torch.compile(DecodeStep(model), backend="fusec")``, whose graph holds the
decode step, the greedy choice of the next token (``argmax``, fused into the LM head's
instruction at batch 1) and the in-place write of that token into the ``[B, 1]`` device tensor
that the next step reads as its ``input_ids``. Sampling (Gumbel-max with temperature, top-k,
top-p) runs as torch ops on the device right after the step (the graph returns the logits):
top-p's sort and cumsum have no fusec instruction, and the generic single-tile instructions that
could hold temperature and top-k measured slower than torch's kernels (:data:`SAMPLE_IN_GRAPH`).

A batch of B > 1 prompts (left-padded, with their ``attention_mask``; or one padded prompt)
decodes through :class:`BatchDecodeStep`, which also takes each sequence's position, the
attention mask over the cache's rows and each sequence's unfinished flag, all device tensors
(:class:`Batch`): the step advances the positions and, past a sequence's end-of-sequence
token, writes the pad token instead of its choice (HF's ``unfinished_sequences``); the driver
sets the mask's column of the row each step writes with one device op before it. Batch 1
without padding keeps :class:`DecodeStep`, whose only input besides the cache is the token.

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
import time
from typing import Any

import torch

from fusec.errors import FusecError
from fusec.fallbacks import LAUNCHED, FallbackWatch
from fusec.fallbacks import warn as warn_fallback
from fusec.frontend import hf_rope
from fusec.frontend.precompiled import PrecompiledStep
from fusec.generation.arguments import (MAX_BATCH, check_args, check_model, check_token_ids,  # noqa: F401 (MAX_BATCH)
                                        eos_ids, pad_id)
from fusec.generation import session
from fusec.generation.batch import Batch, full_attention, host_counted, positions, static_batch
from fusec.generation.selection import finish, gumbel_, select
from fusec.generation.steps import BatchDecodeStep, DecodeStep, own_forward, takes

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


def _selection_in_graph(sample: bool, top_k: int | None, top_p: float | None) -> bool:
    """Whether the token is selected inside the compiled step (else by torch ops on the device
    after it): greedy always (the argmax fuses into the LM head); sampling with
    :data:`SAMPLE_IN_GRAPH`, and never with top-p, whose sort and cumsum have no fusec instruction."""
    return not sample or (SAMPLE_IN_GRAPH and top_p is None)


def _last_logits_only(model: torch.nn.Module) -> dict[str, int]:
    """``{"logits_to_keep": 1}`` where the model's forward takes it (HF's causal LMs): the prefill
    computes the LM head for the last position only, not a ``[prompt_len, vocab]`` matrix
    (770 MB in bf16 for a 3000-token Llama-3 prompt, allocated anew at each new length)."""
    return {"logits_to_keep": 1} if takes(model, "logits_to_keep") else {}


def prefill_logits(model: torch.nn.Module, cuda: bool, input_ids: torch.Tensor, cache: Any,
                   **extra: Any) -> torch.Tensor:
    """The eager prefill's last logits (float ``[B, vocab]``): ``model`` over ``input_ids``
    (int64 ``[B, T]``) into the static ``cache``, with ``extra`` inputs (the mask and positions of
    left-padded prompts), under :func:`_prefill_attention`.

    Raises:
        FusecError: the model's forward failed on these inputs (a RuntimeError of its own code,
            which OOM, NotImplementedError and a device error are not: they pass unchanged): fusec.generate passes the tokens, the cache and a padded batch's
            mask and positions only, where the model's own generate() may prepare more
            (``prepare_inputs_for_generation``: BLOOM's ALiBi mask padded to the cache's rows);
            the model's error is its cause.
    """
    try:
        with _prefill_attention(cuda):
            return model(input_ids=input_ids, past_key_values=cache, use_cache=True,
                         **extra, **_last_logits_only(model)).logits[:, -1]
    except RuntimeError as e:
        if isinstance(e, (torch.OutOfMemoryError, NotImplementedError, getattr(torch, "AcceleratorError", ()))):
            raise   # not the inputs' fault: memory, a missing kernel, a broken device context
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise FusecError(f"fusec.generate: {type(model).__name__}'s prefill of {tuple(input_ids.shape)} tokens on a "
                         f"StaticCache of {cache.max_cache_len} rows failed ({type(e).__name__}: {first}); "
                         "fusec.generate passes the tokens, the cache and a padded batch's mask and positions, "
                         "where this model's own generate() may prepare more of its inputs: use model.generate() "
                         "(with compile_config=CompileConfig(backend=\"fusec\") for fusec's decode steps)") from e


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


class _StepCache(dict):
    """The compiled decode steps kept on a model; copies and pickles of the model start empty.
    ``watch``: the model's :class:`~fusec.frontend.code_fingerprint.CodeWatch` (:func:`_steps_of`)."""

    watch: Any = None

    def __deepcopy__(self, memo: dict) -> "_StepCache":
        return _StepCache()

    def __reduce__(self) -> tuple:
        return (_StepCache, ())


def _compiled_step(model: torch.nn.Module, sample: bool, temperature: float, top_k: int | None,
                   select_in_graph: bool, options: dict[str, Any], precompile: bool = True,
                   batch: tuple[tuple[int, ...], int] | None = None) -> Any:
    """``DecodeStep(...)`` compiled with fusec, kept on the model per selection settings and
    options so that a second call reuses it: precompiled (:data:`PRECOMPILE` and
    ``precompile``) or plain ``torch.compile(..., backend="fusec", options=options)``.
    ``batch``: ``(eos ids, pad id)`` for the masked step of a batch, :class:`BatchDecodeStep`
    (one per settings; each batch size its own trace: the step's guards hold the shapes)."""
    key = (sample, float(temperature) if sample else None, top_k if sample else None, select_in_graph,
           repr(sorted(options.items())), precompile) + (() if batch is None else ("batch", *batch))
    steps = _steps_of(model)
    if key not in steps:
        wrapper = DecodeStep(model, sample, temperature, top_k, select_in_graph) if batch is None else \
            BatchDecodeStep(model, sample, temperature, top_k, select_in_graph, *batch)
        steps[key] = PrecompiledStep(wrapper, model, options) if PRECOMPILE and precompile else \
            torch.compile(own_forward(wrapper), backend="fusec", options=options)   # graphs of its own
    return steps[key]


class _Decoder:
    """The decode loop's device state and its two ways of running a chunk of steps.

    ``tokens`` is int64 ``[B, 1]``; ``batch`` the masked step's other device state
    (:class:`Batch`, :class:`BatchDecodeStep`), None for the batch-1 step
    (:class:`DecodeStep`). ``out`` is int64 ``[max_new_tokens, B]``: row ``k`` the ``k``-th
    new token of every sequence."""

    def __init__(self, step: Any, tokens: torch.Tensor, cache: Any, sample: bool, select_in_graph: bool,
                 temperature: float, top_k: int | None, top_p: float | None, vocab: int,
                 generator: torch.Generator | None, out: torch.Tensor, batch: "Batch | None" = None):
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
            static_batch(tokens, *batch.inputs(), cache, *(() if self.noise is None else (self.noise,)))
        self.graph: Any = None
        self.graph_out: torch.Tensor | None = None

    def draw(self) -> None:
        """Fill this chunk's noise block (a few device kernels; nothing when greedy)."""
        if self.sample:
            gumbel_(self.noise_all.uniform_(generator=self.generator))

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
            nxt = select(logits, self.noise_all[j], self.temperature, self.top_k, self.top_p)
            if self.batch is not None and self.batch.eos:
                nxt = finish(nxt, self.batch.unfinished, self.batch.eos, self.batch.pad)
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


class _DecodeSession(session.Session):
    """The batch-1 decode loop's buffers kept for the next call (:mod:`fusec.generation.session`):
    the static cache and the :class:`_Decoder` (its token, noise buffers and CUDA graph)."""

    def __init__(self, key: tuple, max_len: int, model: torch.nn.Module, cache: Any, dec: _Decoder):
        super().__init__(key, max_len, session.weight_ptrs(model), dec.tokens.device, cache)
        self.dec = dec


def _steps_of(model: torch.nn.Module) -> "_StepCache":
    """The compiled steps and kept sessions of ``model`` (its ``_fusec_generate_steps``; made on
    first use), emptied first when the model's code changed since the last call (one line)."""
    steps = model.__dict__.get("_fusec_generate_steps")
    if steps is None:
        steps = _StepCache()
        object.__setattr__(model, "_fusec_generate_steps", steps)   # not a submodule: no state_dict entry
    if steps.watch is None:
        from fusec.frontend.code_fingerprint import CodeWatch
        steps.watch = CodeWatch(model)
    if not any(getattr(s, "busy", False) for s in steps.values()):   # no guard of theirs sees it
        steps.watch.clear_if_changed(steps, "fusec.generate steps were")
    return steps


def generate(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *,
             attention_mask: torch.Tensor | None = None, do_sample: bool = False,
             temperature: float | None = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None, streamer: Any = None,
             options: dict[str, Any] | None = None, generator: torch.Generator | None = None,
             prompt_lookup_num_tokens: int | None = None, assistant_model: torch.nn.Module | None = None,
             num_assistant_tokens: int | None = None) -> torch.Tensor:
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
        temperature, top_k, top_p: sampling settings, as HF's (``temperature`` None: 1.0; ``top_k`` 0 or None and
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
        assistant_model: a draft model, greedy only: speculative decoding (transformers'
            argument of that name), each step verifying ``num_assistant_tokens`` tokens the draft
            model drafted greedily, its steps fusec steps too (:class:`fusec.prompt_lookup.ModelDrafter`);
            a Hugging Face causal LM on the same device whose token ids mean the same; the
            output is greedy's. One prompt without padding only (B = 1).
        num_assistant_tokens: drafts per step with ``assistant_model``, 1 to ``MAX_QUERY_TOKENS
            - 1`` (None: :data:`fusec.generation.lookup_arguments.ASSISTANT_TOKENS`, 4).

    Returns:
        int64 ``[B, prompt_len + n_new]`` on the model's device: the prompts as given, then the
        new tokens (``n_new``: ``max_new_tokens``, or fewer where every sequence met an eos).

    Raises:
        FusecError: an invalid argument or option (a batch over 16, a mask of another shape, a
            streamer, prompt lookup or a draft model with B > 1, both of these, ...).

    B = 1 without a mask (or with an all-ones one) compiles :class:`DecodeStep`, whose only
    input besides the cache is the token. A batch (or a padded prompt) compiles
    :class:`BatchDecodeStep`: its inputs are the tokens, the positions, the mask over the
    cache's rows and each sequence's unfinished flag, device tensors (:class:`Batch`: the step
    advances the positions in place, one device op before each step sets the mask's column of
    the row it writes); greedy output equals HF ``generate(input_ids, attention_mask=...,
    do_sample=False)``'s token for token (tests/test_generate_batch.py).
    """
    from fusec.config import Options
    from fusec.frontend.value_snapshot import check_at_next_call

    device = check_model(model)
    temperature = 1.0 if temperature is None else temperature   # None: unset, as in HF's configs
    input_ids, mask = check_args(input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p,
                                  pad_token_id, streamer, generator, options, device)
    check_token_ids(model, input_ids)
    from fusec.generation import lookup_arguments
    table = lookup_arguments.position_table_rows(model)
    if table is not None:   # the longest prompt's tokens (a padded batch's positions count its mask's ones)
        longest = input_ids.shape[1] if mask is None else int(mask.sum(1).max())
        if longest + max_new_tokens > table + 1:
            raise FusecError(f"fusec.generate: a prompt of {longest} tokens and max_new_tokens={max_new_tokens} feed "
                             f"positions up to {longest + max_new_tokens - 2}, past {type(model).__name__}'s position "
                             f"table of {table} rows (config.max_position_embeddings; eager raises an index error "
                             f"there): at most {max(0, table + 1 - longest)} new tokens")
    opts = {"check_watchdog": False, **(options or {})}
    Options.from_dict(opts)   # an invalid option fails now, before any work
    check_at_next_call()   # weights written through .data since the last call: their steps build again
    eos = eos_ids(model, eos_token_id)
    pad = pad_id(model, pad_token_id, eos)
    sample = bool(do_sample)
    if assistant_model is None and num_assistant_tokens is not None:
        raise FusecError("fusec.generate: num_assistant_tokens without assistant_model")
    from fusec import prompt_lookup
    prompt_lookup.last_stats.clear()   # the last call's: set again only where drafts run
    if prompt_lookup_num_tokens is not None or assistant_model is not None:
        what = "prompt_lookup_num_tokens" if assistant_model is None else "assistant_model"
        if prompt_lookup_num_tokens is not None and assistant_model is not None:
            raise FusecError("fusec.generate: prompt_lookup_num_tokens and assistant_model both given: "
                             "drafts come from one of them")
        if mask is not None:
            raise FusecError(f"fusec.generate: {what} takes one prompt without padding (batch 1): "
                             f"input_ids has shape {tuple(input_ids.shape)}"
                             + (", attention_mask has zeros" if input_ids.shape[0] == 1 else ""))
        if assistant_model is None:
            num = lookup_arguments.check_num(prompt_lookup_num_tokens, sample)
        else:
            lookup_arguments.check_assistant(assistant_model, device, model.config.vocab_size)
            num = lookup_arguments.check_num(lookup_arguments.ASSISTANT_TOKENS if num_assistant_tokens is None
                                          else num_assistant_tokens, sample, "num_assistant_tokens")
        limit = input_ids.shape[1] + max_new_tokens
        for m in (model,) if assistant_model is None else (model, assistant_model):
            num = lookup_arguments.fit_position_table(m, limit, num, what) if num else 0
        if num:
            return prompt_lookup.generate(model, input_ids, max_new_tokens, num, eos, streamer, opts,
                                          assistant=assistant_model)[0]
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
    steps = _steps_of(model)
    # the batch-1 step's buffers and CUDA graph are kept for the next call
    # (fusec/generation/session.py); a batch's device state (Batch) is made per call, as the
    # buffers of a call made while another runs on the kept ones (inside its streamer's put)
    key = (sample, float(temperature) if sample else None, top_k, top_p, select_in_graph,
           repr(sorted(opts.items())), rows) if mask is None else None
    kept, keep = session.take(steps, session.DECODE, key, model, max_len, device)
    try:
        return _generate(model, input_ids, mask, max_new_tokens, max_len, cuda, sample, select_in_graph,
                         temperature, top_k, top_p, eos, pad, streamer, opts, generator, steps,
                         key if keep else None, kept, t_start)
    except BaseException:
        if keep:
            steps.pop(session.DECODE, None)   # a call that failed midway leaves nothing to reuse
        raise
    finally:
        if keep:
            session.release(steps, session.DECODE)


def _generate(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor | None, max_new_tokens: int,
              max_len: int, cuda: bool, sample: bool, select_in_graph: bool, temperature: float,
              top_k: int | None, top_p: float | None, eos: list[int], pad: int, streamer: Any,
              opts: dict[str, Any], generator: torch.Generator | None, steps: dict, key: tuple | None,
              kept: "_DecodeSession | None", t_start: float) -> torch.Tensor:
    """:func:`generate`'s prefill and decode loop, its arguments checked; ``kept``: the last
    call's buffers to run on (reset here), None: new ones, kept for the next call where ``key``
    is not None (no mask, positions counted on the device, no call running on the kept ones)."""

    device = input_ids.device
    rows = input_ids.shape[0]
    with torch.no_grad():
        # prefill, eagerly: the first new token
        cache = session.cache_of(kept, model, max_len)
        extra: dict[str, Any] = {}
        if mask is not None:   # left-padded prompts: HF's position ids, the padding masked out
            pos0 = positions(mask)
            extra["attention_mask"] = mask
            if takes(model, "position_ids"):
                extra["position_ids"] = pos0
        logits = prefill_logits(model, cuda, input_ids, cache, **extra)
        out = torch.empty(max_new_tokens, rows, dtype=torch.int64, device=device)
        tokens = kept.dec.tokens if kept is not None else torch.empty(rows, 1, dtype=torch.int64, device=device)
        # the masked step's device state (advanced by device ops only)
        batch = None if mask is None else Batch(mask, pos0, max_len, full_attention(model, cache), tuple(eos), pad)
        noise0 = gumbel_(torch.rand(rows, logits.shape[-1], generator=generator, device=device)) if sample else None
        first = select(logits, noise0, temperature, top_k, top_p)
        if batch is not None and eos:
            first = finish(first, batch.unfinished, batch.eos, pad)
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
                from fusec.frontend.static_cache import length_symbolic
                length_symbolic(cache, getattr(model.config.get_text_config(decoder=True), "sliding_window", None))
                if counted:
                    log.info("fusec.generate: the cache's sliding-window layers count positions in Python; "
                             "each step is launched on its own (no CUDA graph, no precompiled step)")
                hf_rope.dynamic_state_as_tensors(model)   # dynamic NTK: one compile, not two
                if kept is not None and not counted:
                    dec = kept.dec
                    dec.out, dec.generator = out, generator
                else:
                    step = _compiled_step(model, sample, temperature, top_k, select_in_graph, opts,
                                          precompile=not counted, batch=None if batch is None else (batch.eos, pad))
                    dec = _Decoder(step, tokens, cache, sample, select_in_graph, temperature, top_k, top_p,
                                   logits.shape[-1], generator, out, batch)
                    if key is not None and not counted:
                        kept = steps[session.DECODE] = _DecodeSession(key, max_len, model, cache, dec)
                n = min(WARMUP if cuda else CHUNK, max_new_tokens - pos)
                t_step = time.perf_counter()
                with FallbackWatch() as w:
                    dec.plain(pos, n)      # the first call compiles; a later one runs the step's guards
                if kept is not None and not session.graph_current(kept, w):
                    dec.graph = None       # a kept graph launches what ran before a compile or a switch
                if w.compiled:   # where a call that compiled or loaded its step spent its host time
                    log.info("fusec.generate: prefill launched in %.2f s, the decode step compiled or loaded "
                             "and %d steps launched in %.2f s (host wall time)", t_step - t_start, n,
                             time.perf_counter() - t_step)
                if w.fallbacks:
                    warn_fallback("fusec.generate: the decode step did not compile with fusec (%s); "
                                  "generating with the fallback (correct, slower)", w.fallbacks[0])
                if cuda and not counted and dec.graph is None and max_new_tokens - pos - n >= CHUNK \
                        and dec.capture() and kept is not None:
                    kept.graph_engine = LAUNCHED[0]
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
