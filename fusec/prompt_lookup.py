"""Prompt-lookup decoding for :func:`fusec.generate`: several tokens per step, greedy's output.

Prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; transformers'
``PromptLookupCandidateGenerator``) drafts the next ``N`` tokens by finding the last n-gram of
the text earlier in the text and copying the ``N`` tokens that followed it. One decode step then
verifies the drafts: the model runs on ``K = N + 1`` query tokens (the last token and the
drafts), the greedy token after each of them is ``argmax`` of its logits, and the drafts are
accepted up to the first one that differs from the greedy token before it. A step yields the
``a`` accepted drafts and one greedy token more (``1 <= a + 1 <= K`` tokens), and the output is
exactly greedy decoding's: every token kept is the argmax after the tokens before it.

Everything stays on the device: the token history ``hist`` (int64 ``[capacity]``: the prompt,
then the new tokens) and its length ``n`` (int64 ``[1]``), the drafts (:func:`draft`, vectorized
n-gram matching), the acceptance (:func:`accept`), and the KV cache's position: the step
writes K cache rows, and each ``StaticLayer.cumulative_length`` is set back to ``n - 1`` (the
rows of the rejected drafts are overwritten by the next step, which starts at the first of
them). On CUDA this bookkeeping runs as two small kernels around the compiled step
(:mod:`fusec.runtime.lookup_kernels`: the drafts, then everything after the step), in place of
some 55 to 110 tiny torch kernels; the torch ops stay the CPU's path and the reference. No value
returns to the host between steps: the host reads ``n`` and ``hist`` one chunk
of :data:`fusec.generate.CHUNK` steps behind the device, as the single-token loop does, and on
CUDA the chunk's steps are replayed from a CUDA graph. ``n`` stops at the output's limit: a step
after the limit recomputes the same rows (no cache row past the capacity is written).

The verification step is ``torch.compile(..., backend="fusec", options={"query_tokens": K})``:
the fusec option ``query_tokens`` lets a compiled step take K query tokens (docs/batch.md).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from fusec.generation import session as session_mod

log = logging.getLogger("fusec")

#: the longest n-gram matched (transformers' ``max_matching_ngram_size`` default)
MAX_NGRAM = 2
#: the last ``fusec.generate`` call's ``{"steps", "accepted", "tokens"}`` (:func:`generate`'s stats;
#: benchmarks read it), empty after a call without drafts
last_stats: dict[str, int] = {}


def draft(hist: torch.Tensor, n: torch.Tensor, num: int, max_ngram: int = MAX_NGRAM) -> torch.Tensor:
    """The ``num`` draft tokens after ``hist[:n]``, by prompt lookup, as device ops (no sync).

    For n-gram sizes ``max_ngram`` down to 1: the earliest position ``i`` with
    ``hist[i:i+size] == hist[n-size:n]`` and ``i + size < n`` (an n-gram with a token after it);
    the drafts are ``hist[i+size : i+size+num]`` for the largest size that matched (as
    transformers' ``PromptLookupCandidateGenerator``, which takes the first match). Without a
    match, or where the copy runs past ``n``, the drafts hold whatever ``hist`` holds there: a
    draft only decides how many tokens a step accepts, never which (:func:`accept`).

    Args:
        hist: int64 ``[capacity]`` token history (any device); positions ``>= n`` are ignored
            for matching.
        n: int64 ``[1]``, the history's length (``>= 1``), on ``hist``'s device.
        num: drafts per step (``N >= 1``).
        max_ngram: the longest n-gram matched (>= 1).

    Returns:
        int64 ``[num]`` on ``hist``'s device.
    """
    cap = hist.shape[0]
    pos = torch.arange(cap, device=hist.device)
    start = torch.zeros_like(n)        # where the copied drafts start (0: no match yet)
    found = torch.zeros_like(n, dtype=torch.bool)
    for size in range(max_ngram, 0, -1):
        if size >= cap:
            continue
        last = hist[(n - size + torch.arange(size, device=hist.device)).clamp(0, cap - 1)]   # [size]
        windows = hist.unfold(0, size, 1)                                                    # [cap-size+1, size]
        ok = (windows == last).all(-1) & (pos[: cap - size + 1] + size < n) & (n >= size)
        first = torch.where(ok, pos[: cap - size + 1], cap).min().view(1)
        hit = ok.any().view(1) & ~found
        start = torch.where(hit, first + size, start)
        found = found | hit
    idx = (start + torch.arange(num, device=hist.device)).clamp(max=cap - 1)
    return hist[idx]


def accept(inp: torch.Tensor, preds: torch.Tensor) -> torch.Tensor:
    """How many drafts a verification step accepts, as a device op.

    Args:
        inp: int64 ``[K]``, the step's query tokens: the last token, then ``K - 1`` drafts.
        preds: int64 ``[K]``, the greedy token after each query token (argmax of its logits).

    Returns:
        int64 ``[1]``: ``a``, the number of leading drafts equal to the greedy token before
        them (``inp[j + 1] == preds[j]`` for every ``j < a``); the step yields ``preds[:a + 1]``.
    """
    same = (inp[1:] == preds[:-1]).long()
    return torch.cumprod(same, 0).sum().view(1)


class VerifyStep(torch.nn.Module):
    """The verification step: ``forward(tokens [1, K], cache) -> preds [K]``, the greedy
    token after each of the K query tokens (``argmax`` of the logits, first among equal).

    Each instance runs its own copy of ``forward``'s code object
    (:func:`fusec.generation.steps.own_forward`): every K of every model and a draft model's two
    steps would otherwise share one, past dynamo's 8 graphs per code object the ninth running
    eagerly without a word (``tests/test_draft_model.py``)."""

    def __init__(self, model: torch.nn.Module):
        from fusec.generation.steps import own_forward
        super().__init__()
        self.model = model
        own_forward(self)

    def forward(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        logits = self.model(input_ids=tokens, past_key_values=cache, use_cache=True).logits
        return logits[0].argmax(-1)


class LookupDecoder:
    """The device state of prompt-lookup decoding and one step of it.

    ``hist`` int64 ``[capacity]`` (the prompt, then the new tokens), ``n`` int64 ``[1]`` its
    length, ``inp`` int64 ``[1, K]`` the next step's query tokens; ``limit`` the largest ``n``
    (prompt + max_new_tokens); ``drafter`` makes the drafts (default: prompt lookup's
    :func:`draft`; a draft model: :class:`ModelDrafter`). :meth:`one` runs a step: ``inp`` from
    ``hist`` and the drafts,
    the compiled verification, the accepted tokens into ``hist``, ``n`` and the cache
    positions advanced; all device ops.
    """

    def __init__(self, step: Any, cache: Any, hist: torch.Tensor, n: int, limit: int, k: int,
                 drafter: Any = None):
        self.step, self.cache, self.k = step, cache, k
        self.hist = hist
        #: ``drafter(hist, n, num) -> int64 [num]`` (device ops): prompt lookup's :func:`draft`,
        #: or a draft model's greedy tokens (:class:`ModelDrafter`)
        self.drafter = drafter if drafter is not None else draft
        dev = hist.device
        self.n = torch.full((1,), n, dtype=torch.int64, device=dev)
        #: the largest ``n``, a device value (a captured CUDA graph serves every limit: :meth:`restart`)
        self.limit = torch.full((1,), limit, dtype=torch.int64, device=dev)
        self.inp = torch.zeros(1, k, dtype=torch.int64, device=dev)
        # the query tokens' dims are fixed: dynamo's automatic dynamic shapes must never make
        # the query length symbolic (a fallback)
        torch._dynamo.mark_static(self.inp, 0)
        torch._dynamo.mark_static(self.inp, 1)
        self.ar = torch.arange(k, device=dev)
        self.steps = torch.zeros(1, dtype=torch.int64, device=dev)      # steps taken before the limit
        self.accepted = torch.zeros(1, dtype=torch.int64, device=dev)   # drafts accepted by them
        #: on CUDA, :meth:`one`'s bookkeeping as two kernels (:mod:`fusec.runtime.lookup_kernels`);
        #: False: the torch ops (the CPU's path, and the reference the kernels are tested against)
        self.device_kernels = hist.is_cuda
        self._lengths: Any = None   # the cache positions' address table (lookup_kernels.LengthTable)

    def restart(self, n: int, limit: int) -> None:
        """A new call over the same buffers: length ``n``, limit ``limit``, counts and history
        zeroed (drafts past the text read zeros, as a new call's; in place: a CUDA graph captured
        over them replays the new call)."""
        self.hist.zero_()
        self.n.fill_(n)
        self.limit.fill_(limit)
        self.steps.zero_()
        self.accepted.zero_()

    def one(self) -> None:
        """One verification step (device ops only): on CUDA the compiled step between the two
        kernels of :mod:`fusec.runtime.lookup_kernels` (:meth:`_one_kernels`), elsewhere (or where
        they cannot load) the torch ops below, their reference."""
        kern = self._kernels() if self.device_kernels and self.hist.is_cuda else None
        if kern is not None:
            self._one_kernels(kern)
            return
        n = self.n
        self.inp[0, :1].copy_(self.hist[n - 1])
        self.inp[0, 1:].copy_(self.drafter(self.hist, n, self.k - 1))
        preds = self.step(self.inp, self.cache)
        a = accept(self.inp[0], preds)
        self.hist.index_copy_(0, n + self.ar, preds)       # preds[:a + 1] are the new tokens
        live = (n < self.limit).long()
        self.steps.add_(live)
        self.accepted.add_(live * torch.minimum(a, torch.clamp(self.limit - n - 1, min=0)))
        new = torch.minimum(n + a + 1, self.limit)
        self.n.copy_(new)                                  # n is self.n: read above, written last
        set_position(self.cache, new - 1)                  # the cache holds hist[:n - 1]

    def _kernels(self) -> Any:
        """The loaded kernels on ``hist``'s device, or None (the torch ops)."""
        from fusec.runtime import lookup_kernels
        return lookup_kernels.kernels(self.hist.device, MAX_NGRAM)

    def _one_kernels(self, kern: Any) -> None:
        """:meth:`one` with its bookkeeping as two launches: ``lookup_draft`` (prompt lookup's
        drafts; a draft model's :class:`ModelDrafter` keeps its own steps, and ``inp`` is filled
        by torch ops), the step, ``lookup_advance`` (everything after it; the cache positions by
        torch ops where a layer's is no int64 element on the device)."""
        if self.drafter is draft:
            kern.draft(self.hist, self.n, self.inp)
        else:
            n = self.n
            self.inp[0, :1].copy_(self.hist[n - 1])
            self.inp[0, 1:].copy_(self.drafter(self.hist, n, self.k - 1))
        preds = self.step(self.inp, self.cache)
        if self._lengths is None:
            from fusec.runtime.lookup_kernels import LengthTable
            self._lengths = LengthTable(self.hist.device)
        lens = self._lengths(self.cache)
        kern.advance(self.inp, preds, self.hist, self.n, self.limit, self.steps, self.accepted, lens)
        if lens is None:
            set_position(self.cache, self.n - 1)


def set_position(cache: Any, pos: torch.Tensor) -> None:
    """Every layer of the static ``cache`` writes its next row at ``pos`` (int64 ``[1]``, a
    device tensor: ``StaticLayer.cumulative_length`` set in place, no host sync): one
    ``torch._foreach_copy_`` (one kernel on CUDA for all layers, not a copy per layer)."""
    lens = [layer.cumulative_length for layer in cache.layers]
    torch._foreach_copy_(lens, [pos.view(())] * len(lens))


class ModelDrafter:
    """Drafts by a draft model's greedy decoding (speculative decoding: Leviathan et al. 2023,
    "Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023; transformers'
    ``AssistedCandidateGenerator`` with ``assistant_model``), as device ops.

    Called as ``drafter(hist, n, num)`` at the start of a verification step: the draft model's
    static ``cache`` holds the rows of ``hist[:n - 2]`` (at least); a step of two query tokens
    feeds ``hist[n - 2], hist[n - 1]`` at positions ``n - 2, n - 1`` (the second to last token
    is fed again: where the previous step accepted every draft, the draft model never saw its
    last one), the argmax after the last is the first draft, and ``num - 1`` one-token steps
    make the others. Afterwards the cache holds rows up to ``n + num - 2``, right wherever the
    target accepted the drafts, so the invariant holds at the next step (``n' - 2 <= n + a - 1``,
    and rows before ``n + a`` hold accepted tokens). Drafts are clamped into the target's
    vocabulary (a draft model with a larger embedding: a draft decides only how many tokens are
    accepted, never which).

    Args:
        pair_step, one_step: the draft model's compiled :class:`VerifyStep` of 2 and of 1 query
            tokens (``[1, K]`` int64 tokens, the cache -> int64 ``[K]`` argmax per row).
        cache: the draft model's static cache, prefilled with the prompt.
        num: drafts per step (``N``); ``vocab``: the target model's vocabulary size.
        new: whether either step was compiled for this call.
    """

    def __init__(self, pair_step: Any, one_step: Any, cache: Any, num: int, vocab: int, device: torch.device,
                 new: bool = False):
        self.pair_step, self.one_step, self.cache, self.vocab = pair_step, one_step, cache, vocab
        self.pair = torch.zeros(1, 2, dtype=torch.int64, device=device)
        self.tok = torch.zeros(1, 1, dtype=torch.int64, device=device)
        for t in (self.pair, self.tok):   # fixed query lengths (LookupDecoder's marks)
            torch._dynamo.mark_static(t, 0)
            torch._dynamo.mark_static(t, 1)
        self.out = torch.zeros(num, dtype=torch.int64, device=device)
        self.two = torch.arange(2, device=device)
        self.new = new   # whether a step was compiled for this call (its first call must reach fusec)

    def __call__(self, hist: torch.Tensor, n: torch.Tensor, num: int) -> torch.Tensor:
        self.pair[0].copy_(hist[n - 2 + self.two])
        set_position(self.cache, n - 2)
        self.out[:1].copy_(self.pair_step(self.pair, self.cache)[1:])
        for j in range(1, num):
            self.tok[0].copy_(self.out[j - 1:j])
            self.out[j:j + 1].copy_(self.one_step(self.tok, self.cache))
        return self.out.clamp(max=self.vocab - 1)


#: the key of the prompt-lookup buffers a model keeps in its ``_fusec_generate_steps`` (:class:`_Session`)
SESSION = session_mod.PROMPT_LOOKUP


class _Session(session_mod.Session):
    """The buffers of a model's last prompt-lookup call, kept for the next one
    (:mod:`fusec.generation.session`): the static cache, the decoder's device state (history,
    length, limit, counts), the pinned host copies and, on CUDA, the graph of
    :data:`fusec.generate.CHUNK` captured steps. A later call with the same verification step
    (the same K and options) whose rows fit resets them in place and replays the same graph."""

    def __init__(self, key: tuple, max_len: int, model: torch.nn.Module, cache: Any, dec: LookupDecoder,
                 host_n: torch.Tensor, host_hist: torch.Tensor):
        super().__init__(key, max_len, session_mod.weight_ptrs(model), dec.hist.device, cache)
        self.dec, self.host_n, self.host_hist = dec, host_n, host_hist
        self.graph: Any = None


def _capture(dec: LookupDecoder, steps: int) -> Any:
    """A CUDA graph of ``steps`` calls of ``dec.one()``; None, with one log line, if the capture failed."""
    g = torch.cuda.CUDAGraph()
    try:
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for _ in range(steps):
                dec.one()
    except Exception as e:   # noqa: BLE001 - the step's launch path is not capturable: plain launches
        log.warning("fusec.generate: capturing %d prompt-lookup steps in a CUDA graph failed (%s: %s); "
                    "launching the steps one by one", steps, type(e).__name__, str(e).strip()[:200])
        try:
            torch.cuda.synchronize()
        except Exception:   # noqa: BLE001 - a sticky error surfaces at the next step anyway
            pass
        return None
    return g


def generate(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, num: int,
             eos: list[int], streamer: Any, options: dict[str, Any],
             assistant: torch.nn.Module | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """Greedy generation with prompt-lookup drafts of ``num`` tokens per step (module docstring),
    or with drafts by the draft model ``assistant`` (:class:`ModelDrafter`).

    Args:
        model: a Hugging Face causal LM on the CPU (simulator) or CUDA, checked by the caller.
        input_ids: int64 ``[1, prompt_len]`` on the model's device.
        max_new_tokens: at most this many new tokens.
        num: drafts per step, ``1 <= num < fusec.config.MAX_QUERY_TOKENS`` (K = num + 1 query
            tokens per step).
        eos: end-of-sequence ids (the output stops after the first, included).
        streamer: None or an object with ``put``/``end`` (gets the prompt, then new tokens).
        options: fusec options of the verification step (``query_tokens`` set to K here), and
            of the draft model's steps.
        assistant: None (prompt lookup), or a draft model: a Hugging Face causal LM on the same
            device whose token ids mean the same (its tokenizer the target's), checked by the
            caller; its steps are fusec steps too, all of a verification step on the device.

    Returns:
        (int64 ``[1, prompt_len + n_new]``, stats ``{"steps", "accepted", "tokens"}``): the
        output equals greedy decoding's; ``accepted`` counts the drafts accepted over ``steps``
        steps (tokens per step = ``tokens / steps``).

    Raises:
        FusecError: a cache whose layers count positions on the host (sliding windows), the
            target's or the draft model's.
    """
    import collections

    from fusec.errors import FusecError
    from fusec.fallbacks import LAUNCHED, FallbackWatch
    from fusec.fallbacks import warn as warn_fallback
    from fusec.frontend.static_cache import length_symbolic
    from fusec.generation.batch import host_counted
    import importlib
    gen_mod = importlib.import_module("fusec.generate")   # the module (fusec.generate is also the function)

    device = input_ids.device
    cuda = device.type == "cuda"
    k = num + 1
    p = input_ids.shape[1]
    limit = p + max_new_tokens
    max_len = -(-(limit + k) // gen_mod.CACHE_ALIGN) * gen_mod.CACHE_ALIGN
    if streamer is not None:
        streamer.put(input_ids.cpu())
    store = gen_mod._steps_of(model)   # the model's compiled steps and kept buffers
    opts = {**options, "query_tokens": max(k, int(options.get("query_tokens", 1)))}
    key = ("prompt_lookup", k, repr(sorted(opts.items())))
    new_steps = key not in store
    if key not in store:
        store[key] = torch.compile(VerifyStep(model), backend="fusec", options=opts)
    # prompt lookup runs on the last call's buffers (and CUDA graph) where they fit this call; a
    # call inside another one's streamer makes its own and keeps nothing; one with a draft model
    # drops them and keeps nothing
    session, keep = session_mod.take(store, SESSION, key if assistant is None else None, model, max_len, device)
    try:
        with torch.no_grad():
            cache = session_mod.cache_of(session, model, max_len)
            logits = gen_mod.prefill_logits(model, cuda, input_ids, cache)
            what = "prompt_lookup_num_tokens" if assistant is None else "assistant_model"
            if host_counted(cache):
                raise FusecError(f"fusec.generate: {what} needs a cache whose layers count "
                                 "positions on the device; this model's sliding-window layers count them on the "
                                 f"host (Mistral, Gemma-2/3, StarCoder2): call it without {what}")
            length_symbolic(cache)
            drafter = None
            if assistant is not None:
                drafter = _model_drafter(assistant, input_ids, max_len, num, model.config.vocab_size, options, cuda)
                new_steps = new_steps or drafter.new
            if session is None:
                hist = torch.zeros(max_len + k, dtype=torch.int64, device=device)
                dec = LookupDecoder(store[key], cache, hist, p + 1, limit, k, drafter)
                host_n = torch.empty(1, dtype=torch.int64, pin_memory=cuda)
                host_hist = torch.empty_like(hist, device="cpu", pin_memory=cuda)
                if keep:
                    session = store[SESSION] = _Session(key, max_len, model, cache, dec, host_n, host_hist)
            else:
                dec, host_n, host_hist = session.dec, session.host_n, session.host_hist
                dec.restart(p + 1, limit)
            hist = dec.hist
            hist[:p] = input_ids[0]
            hist[p:p + 1] = logits.argmax(-1)
            pending: collections.deque = collections.deque()   # (event, steps) per copy in flight
            shown = p
            seen_n = p + 1   # the last length read on the host

            def enqueue(steps: int) -> None:
                # the history before its length: both copies share one host buffer each, and a later
                # copy may land while an earlier one is read; positions below a length never change
                # again, so a length read from the host always has its tokens there
                host_hist.copy_(hist, non_blocking=cuda)
                host_n.copy_(dec.n, non_blocking=cuda)
                ev = None
                if cuda:
                    ev = torch.cuda.Event()
                    ev.record()
                pending.append((ev, steps))

            def consume() -> int | None:
                """The oldest copy on the host: stream its new tokens; the output's end if done."""
                nonlocal shown, seen_n
                ev, steps = pending.popleft()
                if ev is not None:
                    ev.synchronize()
                n = int(host_n[0])
                seen_n = max(seen_n, n)
                new = host_hist[shown:n]
                end = None
                if eos:
                    where = torch.isin(new, torch.tensor(eos, dtype=torch.int64)).nonzero()
                    if len(where):
                        end = shown + int(where[0, 0]) + 1
                        new = new[:end - shown]
                if streamer is not None and len(new):
                    streamer.put(new.clone())
                shown += len(new)
                if end is None and n >= limit:
                    end = limit
                return end

            end = None
            if p + 1 >= limit or (eos and int(hist[p]) in eos):
                end = p + 1
                if streamer is not None:
                    streamer.put(hist[p:p + 1].cpu())
            graph = session.graph if session is not None else None
            first = True
            # the CPU (simulator): one step per chunk, checked at once (no device runs ahead to overlap)
            chunk = gen_mod.CHUNK if cuda else 1
            while end is None:
                if cuda and pending and not first and \
                        limit - seen_n <= k * sum(steps for _, steps in pending):
                    # the steps in flight may end the output (at K tokens a step): read them before
                    # launching more, never a chunk that may run all past the end (docs/batch.md)
                    end = consume()
                    continue
                if first:
                    with FallbackWatch() as w:
                        for _ in range(gen_mod.WARMUP if cuda else 1):
                            dec.one()        # the first call compiles
                    kind = "prompt-lookup" if assistant is None else "speculative-decoding"
                    if w.fallbacks:
                        warn_fallback("fusec.generate: a %s step did not compile with fusec (%s); generating "
                                      "with the fallback (correct, slower)", kind, w.fallbacks[0])
                    elif new_steps and not w.compiled:
                        warn_fallback("fusec.generate: the %s steps never reached fusec (dynamo ran them without "
                                      "calling the backend); generating eagerly (correct, slower)", kind)
                    if session is None or not session_mod.graph_current(session, w):
                        graph = None   # a graph of an earlier call launches what ran before a compile or a switch
                    if cuda and graph is None:
                        graph = _capture(dec, gen_mod.CHUNK)
                        if session is not None:
                            session.graph, session.graph_engine = graph, LAUNCHED[0]
                    first = False
                    steps = gen_mod.WARMUP if cuda else 1
                elif graph is not None:
                    graph.replay()
                    steps = gen_mod.CHUNK
                else:
                    for _ in range(chunk):
                        dec.one()
                    steps = chunk
                enqueue(steps)
                while len(pending) > (1 if cuda else 0) and end is None:   # CUDA: one chunk behind the device
                    end = consume()
            while pending and end is None:
                end = consume()
            if cuda:
                torch.cuda.current_stream(device).synchronize()
            accepted, n_steps = int(dec.accepted), int(dec.steps)
    finally:
        if keep:
            session_mod.release(store, SESSION)
    if streamer is not None:
        streamer.end()
    out = hist[:end].view(1, -1).clone()
    n_new = end - p
    stats = {"steps": n_steps, "accepted": accepted, "tokens": n_new}
    last_stats.clear()
    last_stats.update(stats)
    log.info("fusec.generate: %d new tokens in %d %s steps of K = %d (%d drafts accepted)",
             n_new, n_steps, "prompt-lookup" if assistant is None else "speculative-decoding", k, accepted)
    return out, stats


def _model_drafter(assistant: torch.nn.Module, input_ids: torch.Tensor, max_len: int, num: int, vocab: int,
                   options: dict[str, Any], cuda: bool) -> ModelDrafter:
    """The draft model's :class:`ModelDrafter`: its own static cache of ``max_len`` rows
    prefilled with the prompt (eagerly), its steps of 2 and 1 query tokens compiled with fusec
    (kept on the draft model, as :func:`fusec.generate` keeps its steps).

    Raises:
        FusecError: the draft model's cache counts positions on the host (sliding windows).
    """
    import importlib

    from transformers import StaticCache

    from fusec.errors import FusecError
    from fusec.frontend.static_cache import length_symbolic
    from fusec.generation.batch import host_counted
    gen_mod = importlib.import_module("fusec.generate")
    dcache = StaticCache(config=assistant.config, max_cache_len=max_len)
    with gen_mod._prefill_attention(cuda):
        assistant(input_ids=input_ids, past_key_values=dcache, use_cache=True, **gen_mod._last_logits_only(assistant))
    if host_counted(dcache):
        raise FusecError("fusec.generate: assistant_model needs a draft model whose cache counts positions on the "
                         "device; its sliding-window layers count them on the host (Mistral, Gemma-2/3, StarCoder2)")
    length_symbolic(dcache)
    steps = gen_mod._steps_of(assistant)
    compiled, new = [], False
    for k in (2, 1):
        opts = {**options, "query_tokens": max(k, int(options.get("query_tokens", 1)))}
        key = ("draft", k, repr(sorted(opts.items())))
        if key not in steps:
            steps[key] = torch.compile(VerifyStep(assistant), backend="fusec", options=opts)
            new = True
        compiled.append(steps[key])
    return ModelDrafter(compiled[0], compiled[1], dcache, num, vocab, input_ids.device, new)
