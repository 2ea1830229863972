"""GPU: prompt lookup's bookkeeping kernels (fusec.runtime.lookup_kernels: ``lookup_draft`` and
``lookup_advance``) give exactly what LookupDecoder.one's torch ops give (inp, hist, n, steps,
accepted, every layer's cache position), on many states, eagerly and replayed from a CUDA graph;
and fusec.generate with prompt lookup through them equals greedy decoding and the torch path."""
from __future__ import annotations

import copy

import pytest
import torch

import fusec
import hf_tiny
from fusec import prompt_lookup
from fusec.fallbacks import FallbackWatch
from fusec.prompt_lookup import LookupDecoder
from fusec.runtime import lookup_kernels

pytestmark = pytest.mark.gpu


class _Layer:
    def __init__(self, value: int):
        self.cumulative_length = torch.tensor(value, dtype=torch.int64, device="cuda")


class _Cache:
    """A stand-in static cache: only the layers' positions (int64 0-d tensors on the GPU)."""

    def __init__(self, layers: int, value: int):
        self.layers = [_Layer(value) for _ in range(layers)]


class _Step:
    """A stand-in verification step, device ops only (capturable): at its c-th call the first
    ``agree[c]`` greedy tokens equal the drafts after them (accepted), the others come from a
    random table of a small vocabulary (so some equal a draft by chance)."""

    def __init__(self, k: int, calls: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.agree = torch.randint(0, k, (calls,), generator=g).cuda()
        self.rest = torch.randint(0, vocab, (calls, k), generator=g).cuda()
        self.count = torch.zeros(1, dtype=torch.int64, device="cuda")
        self.ar = torch.arange(k, device="cuda")

    def __call__(self, inp: torch.Tensor, cache) -> torch.Tensor:
        c = self.count % self.agree.shape[0]
        shifted = torch.cat([inp[0, 1:], inp[0, :1]])   # preds[j] = inp[j + 1] accepts draft j + 1
        preds = torch.where(self.ar < self.agree[c], shifted, self.rest[c][0])
        self.count.add_(1)
        return preds


def _history(kind: str, cap: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    if kind == "repeats":      # a small vocabulary: n-grams repeat everywhere
        return torch.randint(0, vocab, (cap,), generator=g)
    if kind == "distinct":     # no token twice: no match of any size
        return torch.randperm(cap, generator=g) + 1000
    if kind == "late":         # distinct tokens but a bigram every 7 from the middle: its first match is late
        h = torch.randperm(cap, generator=g) + 1000
        p = cap // 2
        h[p::7] = h[p].clone()
        h[p + 1::7] = h[min(p + 1, cap - 1)].clone()
        return h
    period = int(torch.randint(2, 9, (1,), generator=g))   # "periodic": a text that repeats with noise
    h = torch.arange(cap) % period
    noise = torch.rand(cap, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, 50, (cap,), generator=g), h)


def _pair(k: int, cap: int, n: int, limit: int, hist: torch.Tensor, layers: int, seed: int, drafter=None,
          vocab: int = 4):
    """Two decoders over equal states: one through the kernels, one through the torch ops."""
    decs = []
    for kernels in (True, False):
        cache = _Cache(layers, n - 1)
        dec = LookupDecoder(_Step(k, 37, vocab, seed), cache, hist.clone().cuda(), n, limit, k, drafter)
        dec.device_kernels = kernels
        dec.steps.fill_(seed % 5)
        dec.accepted.fill_(seed % 3)
        decs.append(dec)
    return decs


def _assert_same(a: LookupDecoder, b: LookupDecoder, what) -> None:
    for name in ("inp", "hist", "n", "steps", "accepted"):
        assert torch.equal(getattr(a, name), getattr(b, name)), (what, name, getattr(a, name), getattr(b, name))
    got = torch.stack([la.cumulative_length for la in a.cache.layers])
    ref = torch.stack([lb.cumulative_length for lb in b.cache.layers])
    assert torch.equal(got, ref), (what, "cumulative_length", got, ref)


def _states(k: int, seed: int):
    """(name, cap, n, limit, history kind): n from 1 to the capacity, at and below the limit."""
    g = torch.Generator().manual_seed(seed)
    for cap in (k + 3, 64, 700, 5000, 20000):
        top = cap - k   # hist holds limit + k positions, as fusec.generate's (max_len + k)
        for n, limit in ((1, top), (2, top), (min(3, top), min(3, top)), (top, top), (top - 1, top),
                         (max(1, top // 2), top), (int(torch.randint(1, top + 1, (1,), generator=g)), top)):
            if not 1 <= n <= limit:
                continue
            for kind in ("repeats", "distinct", "late", "periodic"):
                yield f"cap={cap} n={n} limit={limit} {kind}", cap, n, limit, kind


@pytest.mark.parametrize("k", [2, 4, 8])
def test_kernels_equal_the_torch_ops_on_many_states(k):
    assert lookup_kernels.kernels(torch.device("cuda"), prompt_lookup.MAX_NGRAM) is not None
    g = torch.Generator().manual_seed(k)
    cases = 0
    for seed, (what, cap, n, limit, kind) in enumerate(_states(k, k)):
        hist = _history(kind, cap, 4, g)
        a, b = _pair(k, cap, n, limit, hist, layers=(3, 40)[seed % 2], seed=seed)
        for step in range(6):   # each step starts from the state the last one left
            a.one()
            b.one()
            _assert_same(a, b, (what, step))
        cases += 1
    assert cases > 80


@pytest.mark.parametrize("k", [2, 4, 8])
def test_draft_kernel_equals_draft(k):
    """``lookup_draft`` alone: inp = [hist[n - 1], draft(hist, n, K - 1)] for every n of a
    history with repeats (matches of size 2, of size 1 only, none)."""
    kern = lookup_kernels.kernels(torch.device("cuda"), prompt_lookup.MAX_NGRAM)
    g = torch.Generator().manual_seed(100 + k)
    for kind, cap in [(kind, cap) for kind in ("repeats", "periodic", "late", "distinct") for cap in (3000, 20000)]:
        hist = _history(kind, cap, 6, g).cuda()
        inp = torch.zeros(1, k, dtype=torch.int64, device="cuda")
        for n in list(range(1, 40)) + list(range(cap - 40, cap + 1)):
            nt = torch.tensor([n], device="cuda")
            kern.draft(hist, nt, inp)
            ref = torch.cat([hist[nt - 1], prompt_lookup.draft(hist, nt, k - 1)])
            assert torch.equal(inp[0], ref), (kind, n, inp[0].tolist(), ref.tolist())


def test_a_draft_model_uses_the_advance_kernel_only():
    """A drafter other than prompt lookup's (a draft model's ModelDrafter): inp from its drafts
    (torch ops), the rest through ``lookup_advance``; equal to the torch path."""
    k, cap = 4, 300

    def drafter(hist, n, num):
        idx = (n - 1 + torch.arange(num, device=hist.device)).clamp(max=hist.shape[0] - 1)
        return (hist[idx] * 7 + 1) % 4

    hist = _history("repeats", cap, 4, torch.Generator().manual_seed(7))
    a, b = _pair(k, cap, 5, cap - k, hist, layers=5, seed=7, drafter=drafter)
    for step in range(10):
        a.one()
        b.one()
        _assert_same(a, b, ("draft model", step))


def test_kernels_replay_from_a_cuda_graph():
    """The launches (cuLaunchKernel on torch's current stream) captured by torch.cuda.graph with
    the step, as fusec.generate's chunks are (prompt_lookup._capture): replays read and advance the
    state in place, equal to the torch ops' graph."""
    k, cap = 4, 2000
    hist = _history("periodic", cap, 4, torch.Generator().manual_seed(11))
    a, b = _pair(k, cap, 40, cap - k, hist, layers=6, seed=11)
    for dec in (a, b):
        dec.one()   # warm-up: the kernels loaded, the position table built
    _assert_same(a, b, "warm-up")
    graphs = [prompt_lookup._capture(dec, 5) for dec in (a, b)]
    assert all(gr is not None for gr in graphs)
    for replay in range(4):
        for gr in graphs:
            gr.replay()
        torch.cuda.synchronize()
        _assert_same(a, b, ("replay", replay))
    assert int(a.n) > 40


def test_a_moved_position_gets_a_new_table():
    """A layer whose position tensor is replaced: the next step writes the new tensor (the
    address table is built again), the old one keeps its value."""
    k, cap = 2, 100
    hist = _history("repeats", cap, 3, torch.Generator().manual_seed(5))
    a, b = _pair(k, cap, 10, cap - k, hist, layers=2, seed=5)
    a.one()
    b.one()
    old = a.cache.layers[1].cumulative_length
    kept = old.clone()
    for dec in (a, b):
        dec.cache.layers[1].cumulative_length = torch.tensor(0, dtype=torch.int64, device="cuda")
    a.one()
    b.one()
    _assert_same(a, b, "moved")
    assert torch.equal(old, kept)


def _varied_llama():
    """Tests/test_gpu_generate.py's prompt-lookup model: a tiny Llama with its own LM head (its
    text varies and repeats in part), on the GPU, and a prompt."""
    model = hf_tiny.llama(layers=2, seed=3)
    g = torch.Generator().manual_seed(3)
    model.lm_head.weight = torch.nn.Parameter(torch.randn(model.lm_head.weight.shape, generator=g) * 0.3)
    prompt = torch.randint(0, 128, (1, 12), generator=g)
    return model.cuda(), prompt.cuda()


@pytest.mark.parametrize("num", [1, 3, 7])
def test_generate_through_the_kernels_equals_greedy_and_the_torch_ops(num, monkeypatch):
    """fusec.generate(prompt_lookup_num_tokens=num): the steps run the kernels (warm-up and the
    captured chunks), the tokens equal HF eager greedy's, and the tokens and stats (steps,
    accepted) equal those of the torch ops' path (the kernels turned off)."""
    model, prompt = _varied_llama()
    twin = copy.deepcopy(model)
    ref = model.generate(prompt, max_new_tokens=48, do_sample=False, attention_mask=torch.ones_like(prompt),
                         eos_token_id=None, pad_token_id=0, disable_compile=True)
    calls = []
    real = LookupDecoder._one_kernels

    def counted(self, kern):
        calls.append(1)
        real(self, kern)

    torch._dynamo.reset()
    try:
        monkeypatch.setattr(LookupDecoder, "_one_kernels", counted)
        with FallbackWatch() as w:
            out = fusec.generate(model, prompt, 48, prompt_lookup_num_tokens=num, eos_token_id=[])
        stats = dict(prompt_lookup.last_stats)
        monkeypatch.setattr(LookupDecoder, "_kernels", lambda self: None)
        torch_out = fusec.generate(twin, prompt, 48, prompt_lookup_num_tokens=num, eos_token_id=[])
        torch_stats = dict(prompt_lookup.last_stats)
    finally:
        torch._dynamo.reset()
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert calls, "the kernels never ran"
    assert torch.equal(out, ref), (out[0, 12:].tolist(), ref[0, 12:].tolist())
    assert torch.equal(torch_out, out)
    assert stats == torch_stats, (stats, torch_stats)
    if num > 1:
        assert stats["steps"] < 47, stats
