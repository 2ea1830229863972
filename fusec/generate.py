"""``fusec.generate``: batch-1 text generation whose tokens stay on the device between steps.

:func:`generate` runs the prompt eagerly (the prefill), then every new token through one
compiled step, ``torch.compile(_DecodeStep(model), backend="fusec")``, whose graph holds the
decode step, the greedy choice of the next token (``argmax``, fused into the LM head's
instruction) and the in-place write of that token into the ``[1, 1]`` device tensor that the
next step reads as its ``input_ids``. Sampling (Gumbel-max with temperature, top-k, top-p) runs
as torch ops on the device right after the step (the graph returns the logits): top-p's sort
and cumsum have no fusec instruction, and the generic single-tile instructions that could hold
temperature and top-k measured slower than torch's kernels (:data:`SAMPLE_IN_GRAPH`).

No token goes back to the host to start the next step. The host learns the tokens one chunk
(:data:`CHUNK` steps) at a time, one chunk behind the device: after enqueueing chunk ``c`` it
waits for chunk ``c - 1``'s asynchronous device-to-host copy, hands it to the streamer and
looks for an end-of-sequence token in it. On CUDA, after :data:`WARMUP` plain steps (compile),
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


def _gumbel_(u: torch.Tensor) -> torch.Tensor:
    """Uniform samples in [0, 1) -> standard Gumbel samples ``-log(-log(u))``, in place."""
    return u.clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_().log_().neg_()


def _select(logits: torch.Tensor, gumbel: torch.Tensor | None, temperature: float,
            top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The next token, int64 ``[1]``, from the last position's logits ``[1, V]``.

    ``gumbel`` None: greedy (``argmax``, first index among equal maxima). Otherwise ``gumbel``
    holds standard Gumbel samples ``[1, V]`` (:func:`_gumbel_`) and the token is a sample of
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


def _check_args(input_ids: Any, max_new_tokens: Any, do_sample: bool, temperature: Any, top_k: Any,
                top_p: Any, streamer: Any, generator: Any, options: Any, device: torch.device) -> torch.Tensor:
    """The prompt as int64 [1, n] on ``device``, after checking every argument.

    Raises:
        FusecError: the first invalid argument, named with what it must be.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        got = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise FusecError(f"fusec.generate: input_ids must be an int64 (or int32) tensor of token ids, got {got}")
    if input_ids.dim() == 1:
        input_ids = input_ids.view(1, -1)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise FusecError(f"fusec.generate: batch must be 1: input_ids has shape {tuple(input_ids.shape)}, "
                         "expected [1, prompt_len]")
    if input_ids.shape[1] < 1:
        raise FusecError("fusec.generate: the prompt is empty (input_ids has shape [1, 0])")
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
    if streamer is not None and not all(callable(getattr(streamer, m, None)) for m in ("put", "end")):
        raise FusecError("fusec.generate: streamer must have put(tensor) and end() (transformers' TextStreamer API)")
    if options is not None and not isinstance(options, dict):
        raise FusecError(f"fusec.generate: options must be a dict of fusec options, got {type(options).__name__}")
    return input_ids.to(device=device, dtype=torch.int64)


def _last_logits_only(model: torch.nn.Module) -> dict[str, int]:
    """``{"logits_to_keep": 1}`` where the model's forward takes it (HF's causal LMs): the prefill
    computes the LM head for the last position only, not a ``[prompt_len, vocab]`` matrix
    (770 MB in bf16 for a 3000-token Llama-3 prompt, allocated anew at each new length)."""
    import inspect
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


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
                   select_in_graph: bool, options: dict[str, Any], precompile: bool = True) -> Any:
    """``_DecodeStep(...)`` compiled with fusec, kept on the model per selection settings and
    options so that a second call reuses it: precompiled (:data:`PRECOMPILE` and
    ``precompile``) or plain ``torch.compile(..., backend="fusec", options=options)``."""
    key = (sample, float(temperature) if sample else None, top_k if sample else None, select_in_graph,
           repr(sorted(options.items())), precompile)
    steps = model.__dict__.get("_fusec_generate_steps")
    if steps is None:
        steps = _StepCache()
        object.__setattr__(model, "_fusec_generate_steps", steps)   # not a submodule: no state_dict entry
    if key not in steps:
        wrapper = _DecodeStep(model, sample, temperature, top_k, select_in_graph)
        steps[key] = PrecompiledStep(wrapper, model, options) if PRECOMPILE and precompile else \
            torch.compile(wrapper, backend="fusec", options=options)
    return steps[key]


class _Decoder:
    """The decode loop's device state and its two ways of running a chunk of steps."""

    def __init__(self, step: Any, tokens: torch.Tensor, cache: Any, sample: bool, select_in_graph: bool,
                 temperature: float, top_k: int | None, top_p: float | None, vocab: int,
                 generator: torch.Generator | None, out: torch.Tensor):
        self.step, self.tokens, self.cache = step, tokens, cache
        self.sample, self.select_in_graph = sample, select_in_graph
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = generator
        self.out = out                        # [max_new_tokens] int64 on the device
        dev = tokens.device
        # Gumbel noise: a [CHUNK, V] block drawn once per chunk (graph and plain paths draw
        # the same numbers); row j is step j's. The compiled step reads it from one [1, V]
        # input of fixed address (the kernel's pointer table is not rewritten inside a graph).
        self.noise_all = torch.zeros(CHUNK, vocab, dtype=torch.float32, device=dev) if sample else None
        self.noise = torch.zeros(1, vocab, dtype=torch.float32, device=dev) \
            if sample and select_in_graph else None
        self.graph: Any = None
        self.graph_out: torch.Tensor | None = None

    def draw(self) -> None:
        """Fill this chunk's noise block (a few device kernels; nothing when greedy)."""
        if self.sample:
            _gumbel_(self.noise_all.uniform_(generator=self.generator))

    def one(self, j: int) -> None:
        """Decode step ``j`` of the chunk: ``tokens`` holds the new token afterwards."""
        if not self.sample:
            self.step(self.tokens, self.cache)
        elif self.select_in_graph:
            self.noise.copy_(self.noise_all[j:j + 1])
            self.step(self.tokens, self.cache, self.noise)
        else:
            logits = self.step(self.tokens, self.cache)
            nxt = _select(logits, self.noise_all[j:j + 1], self.temperature, self.top_k, self.top_p)
            self.tokens.copy_(nxt.view(1, 1))

    def plain(self, pos: int, n: int) -> None:
        """``n`` steps launched one by one; token ``k`` goes to ``out[pos + k]`` (device copy)."""
        self.draw()
        for j in range(n):
            self.one(j)
            self.out[pos + j:pos + j + 1].copy_(self.tokens.view(1))

    def capture(self) -> bool:
        """Capture ``CHUNK`` steps (and their token copies into a [CHUNK] buffer) into a CUDA
        graph. False, with one log line, if the capture failed."""
        buf = torch.zeros(CHUNK, dtype=torch.int64, device=self.tokens.device)
        g = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                for j in range(CHUNK):
                    self.one(j)
                    buf[j:j + 1].copy_(self.tokens.view(1))
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


def generate(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | list[int] | None = None, streamer: Any = None,
             options: dict[str, Any] | None = None, generator: torch.Generator | None = None,
             prompt_lookup_num_tokens: int | None = None) -> torch.Tensor:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (batch 1), each decode step
    one fusec megakernel launch, with no token returning to the host between steps.

    Args:
        model: a Hugging Face causal LM (``...ForCausalLM``) on the CPU (simulator target) or CUDA.
        input_ids: the prompt, int64 ``[1, prompt_len]`` (or ``[prompt_len]``).
        max_new_tokens: at most this many new tokens (>= 1).
        do_sample: sample (Gumbel-max over ``softmax(logits / temperature)``) instead of greedy.
        temperature, top_k, top_p: sampling settings, as HF's (``top_k`` 0 or None and
            ``top_p`` None or 1.0: no filtering); ignored when greedy.
        eos_token_id: an int or a list of ints; None: ``model.generation_config.eos_token_id``
            (as HF). Generation stops after the first of them, which is included; ``[]``: never.
        streamer: an object with ``put(tensor)`` and ``end()`` (transformers' ``TextStreamer``):
            ``put`` gets the prompt, then the new tokens one chunk at a time (CPU tensors).
        options: fusec options for the decode step (:class:`fusec.config.Options`);
            ``check_watchdog`` defaults to False here (it would read the GPU's status after
            every step).
        generator: a ``torch.Generator`` on the model's device for sampling (None: torch's default).
        prompt_lookup_num_tokens: N, greedy only: prompt-lookup decoding (transformers' argument of
            that name), each step verifying N tokens drafted from earlier in the text, 1 to
            ``MAX_QUERY_TOKENS - 1`` (:mod:`fusec.prompt_lookup`); the output is greedy's.

    Returns:
        int64 ``[1, prompt_len + n_new]`` on the model's device: the prompt, then the new tokens.

    Raises:
        FusecError: an invalid argument or option.
    """
    from transformers import StaticCache

    from fusec.config import Options

    device = _check_model(model)
    input_ids = _check_args(input_ids, max_new_tokens, do_sample, temperature, top_k, top_p, streamer,
                            generator, options, device)
    opts = {"check_watchdog": False, **(options or {})}
    Options.from_dict(opts)   # an invalid option fails now, before any work
    eos = _eos_ids(model, eos_token_id)
    sample = bool(do_sample)
    if prompt_lookup_num_tokens is not None:
        from fusec import prompt_lookup
        num = prompt_lookup.check_num(prompt_lookup_num_tokens, sample)
        return prompt_lookup.generate(model, input_ids, max_new_tokens, num, eos, streamer, opts)[0]
    if sample:
        top_k = top_k or None
        top_p = None if top_p is None or float(top_p) >= 1.0 else float(top_p)
    else:
        top_k = top_p = None
    select_in_graph = _selection_in_graph(sample, top_k, top_p)
    cuda = device.type == "cuda"
    prompt_len = input_ids.shape[1]
    max_len = -(-(prompt_len + max_new_tokens) // CACHE_ALIGN) * CACHE_ALIGN
    if streamer is not None:
        streamer.put(input_ids.cpu())

    t_start = time.perf_counter()
    with torch.no_grad():
        # prefill, eagerly: the first new token
        cache = StaticCache(config=model.config, max_cache_len=max_len)
        with _prefill_attention(cuda):
            logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True,
                           **_last_logits_only(model)).logits[:, -1]
        out = torch.empty(max_new_tokens, dtype=torch.int64, device=device)
        tokens = torch.empty(1, 1, dtype=torch.int64, device=device)
        noise0 = _gumbel_(torch.rand(1, logits.shape[-1], generator=generator, device=device)) if sample else None
        first = _select(logits, noise0, temperature, top_k, top_p)
        tokens.copy_(first.view(1, 1))
        out[:1].copy_(first.view(1))

        host = torch.empty(max_new_tokens, dtype=torch.int64, pin_memory=cuda)
        pending: collections.deque = collections.deque()   # (start, n, event) copied or in flight

        def enqueue_host(start: int, n: int) -> None:
            host[start:start + n].copy_(out[start:start + n], non_blocking=cuda)
            ev = None
            if cuda:
                ev = torch.cuda.Event()
                ev.record()
            pending.append((start, n, ev))

        def consume() -> int | None:
            """Take the oldest chunk on the host: stream it; the output's length if it ends in eos."""
            start, n, ev = pending.popleft()
            if ev is not None:
                ev.synchronize()
            chunk = host[start:start + n]
            hit = None
            if eos:
                where = torch.isin(chunk, torch.tensor(eos, dtype=torch.int64)).nonzero()
                if len(where):
                    hit = int(where[0, 0])
                    chunk = chunk[:hit + 1]
            if streamer is not None:
                streamer.put(chunk.clone())
            return None if hit is None else start + hit + 1

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
                                      precompile=not counted)
                dec = _Decoder(step, tokens, cache, sample, select_in_graph, temperature, top_k, top_p,
                               logits.shape[-1], generator, out)
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
    return torch.cat([input_ids, out[:n_new].view(1, -1)], dim=1)


class _CallableModule(type(collections)):
    """``fusec.generate`` is this module's function, but importing the submodule
    (``from fusec.generate import ...``) binds the module to the package attribute of the same
    name: calling the module calls the function, so ``fusec.generate(...)`` works either way."""

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return generate(*args, **kwargs)


import sys as _sys  # noqa: E402

_sys.modules[__name__].__class__ = _CallableModule
