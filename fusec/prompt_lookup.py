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
them). No value returns to the host between steps: the host reads ``n`` and ``hist`` one chunk
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

log = logging.getLogger("fusec")

#: the longest n-gram matched (transformers' ``max_matching_ngram_size`` default)
MAX_NGRAM = 2
#: the last call's ``{"steps", "accepted", "tokens"}`` (:func:`generate`'s stats; benchmarks read it)
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


def check_num(num: Any, sample: bool) -> int:
    """``num`` (drafts per step) checked: an int from 1 to ``MAX_QUERY_TOKENS - 1``, greedy only.

    Raises:
        FusecError: naming the argument and its range, or sampling asked with it.
    """
    from fusec.config import MAX_QUERY_TOKENS
    from fusec.errors import FusecError
    if isinstance(num, bool) or not isinstance(num, int) or not 1 <= num < MAX_QUERY_TOKENS:
        raise FusecError(f"fusec.generate: prompt_lookup_num_tokens={num!r} must be an int from 1 to "
                         f"{MAX_QUERY_TOKENS - 1} (a step verifies it plus one token, at most "
                         f"{MAX_QUERY_TOKENS} query tokens)")
    if sample:
        raise FusecError("fusec.generate: prompt_lookup_num_tokens works with greedy decoding only "
                         "(do_sample=False)")
    return num


def position_table_rows(model: torch.nn.Module) -> int | None:
    """Rows of the model's learned absolute position table (GPT-2's ``wpe``: an ``nn.Embedding``
    other than the token embedding with ``config.max_position_embeddings`` rows), or None (RoPE
    and other computed positions take any position)."""
    rows = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(rows, int):
        return None
    try:
        tokens = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        tokens = None
    return rows if any(isinstance(m, torch.nn.Embedding) and m is not tokens and m.num_embeddings == rows
                       for m in model.modules()) else None


def fit_position_table(model: torch.nn.Module, limit: int, num: int) -> int:
    """The drafts per step, at most ``num``, whose verification steps stay inside a learned position
    table: a step at length ``n`` (at most ``limit``, the prompt + max_new_tokens) runs its K = num
    + 1 rows at positions ``n - 1 .. n + num - 1``, past what greedy decoding reads, so that
    ``limit + num`` rows must exist. 0: no drafts fit (generate greedily, one token per step).
    Logs one line when it takes fewer than ``num``."""
    rows = position_table_rows(model)
    if rows is None or limit + num <= rows:
        return num
    fit = max(0, rows - limit)
    log.info("fusec.generate: prompt_lookup_num_tokens %d -> %d: the verification step's rows would pass "
             "the model's %d-row position table (prompt + max_new_tokens = %d)%s", num, fit, rows, limit,
             "; generating one token per step" if fit == 0 else "")
    return fit


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
    token after each of the K query tokens (``argmax`` of the logits, first among equal)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        logits = self.model(input_ids=tokens, past_key_values=cache, use_cache=True).logits
        return logits[0].argmax(-1)


class LookupDecoder:
    """The device state of prompt-lookup decoding and one step of it.

    ``hist`` int64 ``[capacity]`` (the prompt, then the new tokens), ``n`` int64 ``[1]`` its
    length, ``inp`` int64 ``[1, K]`` the next step's query tokens; ``limit`` the largest ``n``
    (prompt + max_new_tokens). :meth:`one` runs a step: ``inp`` from ``hist`` and the drafts,
    the compiled verification, the accepted tokens into ``hist``, ``n`` and the cache
    positions advanced; all device ops.
    """

    def __init__(self, step: Any, cache: Any, hist: torch.Tensor, n: int, limit: int, k: int):
        self.step, self.cache, self.k, self.limit = step, cache, k, limit
        self.hist = hist
        dev = hist.device
        self.n = torch.full((1,), n, dtype=torch.int64, device=dev)
        self.inp = torch.zeros(1, k, dtype=torch.int64, device=dev)
        # every K compiles VerifyStep.forward, one code object: without the marks dynamo's
        # automatic dynamic shapes would make the query length symbolic at a second K (a fallback)
        torch._dynamo.mark_static(self.inp, 0)
        torch._dynamo.mark_static(self.inp, 1)
        self.ar = torch.arange(k, device=dev)
        self.steps = torch.zeros(1, dtype=torch.int64, device=dev)      # steps taken before the limit
        self.accepted = torch.zeros(1, dtype=torch.int64, device=dev)   # drafts accepted by them

    def one(self) -> None:
        """One verification step (device ops only)."""
        n = self.n
        self.inp[0, :1].copy_(self.hist[n - 1])
        self.inp[0, 1:].copy_(draft(self.hist, n, self.k - 1))
        preds = self.step(self.inp, self.cache)
        a = accept(self.inp[0], preds)
        self.hist.index_copy_(0, n + self.ar, preds)       # preds[:a + 1] are the new tokens
        live = (n < self.limit).long()
        self.steps.add_(live)
        self.accepted.add_(live * torch.minimum(a, torch.clamp(self.limit - n - 1, min=0)))
        new = torch.clamp(n + a + 1, max=self.limit)
        self.n.copy_(new)                                  # n is self.n: read above, written last
        for layer in self.cache.layers:                    # the cache holds hist[:n - 1]
            layer.cumulative_length.copy_((new - 1).view(()))


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
             eos: list[int], streamer: Any, options: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Greedy generation with prompt-lookup drafts of ``num`` tokens per step (module docstring).

    Args:
        model: a Hugging Face causal LM on the CPU (simulator) or CUDA, checked by the caller.
        input_ids: int64 ``[1, prompt_len]`` on the model's device.
        max_new_tokens: at most this many new tokens.
        num: drafts per step, ``1 <= num < fusec.config.MAX_QUERY_TOKENS`` (K = num + 1 query
            tokens per step).
        eos: end-of-sequence ids (the output stops after the first, included).
        streamer: None or an object with ``put``/``end`` (gets the prompt, then new tokens).
        options: fusec options of the verification step (``query_tokens`` set to K here).

    Returns:
        (int64 ``[1, prompt_len + n_new]``, stats ``{"steps", "accepted", "tokens"}``): the
        output equals greedy decoding's; ``accepted`` counts the drafts accepted over ``steps``
        steps (tokens per step = ``tokens / steps``).

    Raises:
        FusecError: a cache whose layers count positions on the host (sliding windows).
    """
    import collections

    from transformers import StaticCache

    from fusec.errors import FusecError
    from fusec.fallbacks import FallbackWatch
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
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=max_len)
        with gen_mod._prefill_attention(cuda):
            logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True,
                           **gen_mod._last_logits_only(model)).logits[:, -1]
        if host_counted(cache):
            raise FusecError("fusec.generate: prompt_lookup_num_tokens needs a cache whose layers count "
                             "positions on the device; this model's sliding-window layers count them on the "
                             "host (Mistral, Gemma-2/3, StarCoder2): call it without prompt_lookup_num_tokens")
        length_symbolic(cache)
        hist = torch.zeros(limit + k, dtype=torch.int64, device=device)
        hist[:p] = input_ids[0]
        hist[p:p + 1] = logits.argmax(-1)
        steps = model.__dict__.get("_fusec_generate_steps")
        if steps is None:
            steps = gen_mod._StepCache()
            object.__setattr__(model, "_fusec_generate_steps", steps)
        opts = {**options, "query_tokens": max(k, int(options.get("query_tokens", 1)))}
        key = ("prompt_lookup", k, repr(sorted(opts.items())))
        if key not in steps:
            steps[key] = torch.compile(VerifyStep(model), backend="fusec", options=opts)
        dec = LookupDecoder(steps[key], cache, hist, p + 1, limit, k)

        host_n = torch.empty(1, dtype=torch.int64, pin_memory=cuda)
        host_hist = torch.empty_like(hist, device="cpu", pin_memory=cuda)
        pending: collections.deque = collections.deque()
        shown = p

        def enqueue() -> None:
            host_n.copy_(dec.n, non_blocking=cuda)
            host_hist.copy_(hist, non_blocking=cuda)
            ev = None
            if cuda:
                ev = torch.cuda.Event()
                ev.record()
            pending.append(ev)

        def consume() -> int | None:
            """The oldest copy on the host: stream its new tokens; the output's end if done."""
            nonlocal shown
            ev = pending.popleft()
            if ev is not None:
                ev.synchronize()
            n = int(host_n[0])
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
        graph = None
        first = True
        # the CPU (simulator): one step per chunk, checked at once (no device runs ahead to overlap)
        chunk = gen_mod.CHUNK if cuda else 1
        while end is None:
            if first:
                with FallbackWatch() as w:
                    for _ in range(gen_mod.WARMUP if cuda else 1):
                        dec.one()        # the first call compiles
                if w.fallbacks:
                    warn_fallback("fusec.generate: the prompt-lookup verification step did not compile with "
                                  "fusec (%s); generating with the fallback (correct, slower)", w.fallbacks[0])
                if cuda:
                    graph = _capture(dec, gen_mod.CHUNK)
                first = False
            elif graph is not None:
                graph.replay()
            else:
                for _ in range(chunk):
                    dec.one()
            enqueue()
            while len(pending) > (1 if cuda else 0) and end is None:   # CUDA: one chunk behind the device
                end = consume()
        while pending and end is None:
            end = consume()
        if cuda:
            torch.cuda.current_stream(device).synchronize()
        accepted, n_steps = int(dec.accepted), int(dec.steps)
    if streamer is not None:
        streamer.end()
    out = hist[:end].view(1, -1).clone()
    n_new = end - p
    stats = {"steps": n_steps, "accepted": accepted, "tokens": n_new}
    last_stats.clear()
    last_stats.update(stats)
    log.info("fusec.generate: %d new tokens in %d prompt-lookup steps of K = %d (%d drafts accepted)",
             n_new, n_steps, k, accepted)
    return out, stats
