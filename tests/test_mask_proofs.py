"""``fusec.ir.mask_proofs.token_positions`` (issue 32, a K-token step's causal mask): it proves a
mask equal to ``row <= pos[k]`` at every counter value of a chunk at once, and refuses a mask or
write positions that differ at a single counter value. The mask's ops are stood in for by their
values (``position.evaluate_many``), so each case states exactly what the proof sees."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from fusec.ir import mask_proofs, position

K, L = 4, 96


def _graph():
    return NS(tensors={"mask": NS(dtype=torch.bool, shape=(1, 1, K, L), numel=K * L),
                       "wp": NS(dtype=torch.int64, numel=K)},
              ops=[NS(kind="kv_write", inputs={"pos": "wp"})], lengths=(), batch=lambda: 1)


def _proof(monkeypatch, mask_at, pos_at):
    """token_positions over a graph whose mask at counter value p is ``mask_at(p)`` [K, L] and
    whose write positions are ``pos_at(p)`` [K]."""
    monkeypatch.setattr(position, "only_counter", lambda dep, g, t, ctrs: "c")

    def evaluate_many(g, names, c, ps, weights):
        vals = {"mask": torch.stack([mask_at(p) for p in ps])[:, None, None], "wp": torch.stack([pos_at(p) for p in ps])}
        return {n: vals[n] for n in names}
    monkeypatch.setattr(position, "evaluate_many", evaluate_many)
    return mask_proofs.token_positions(_graph(), "mask", None, None, None, L)


def _causal(p):
    return torch.arange(L)[None, :] <= (p + torch.arange(K))[:, None]


def _pos(p):
    return p + torch.arange(K)


def test_hfs_causal_mask_is_proven_the_write_positions(monkeypatch):
    assert _proof(monkeypatch, _causal, _pos) == "wp"


@pytest.mark.parametrize("case", ["one element at one position", "positions not ending at the largest",
                                  "a position past the cache", "a negative position"])
def test_a_mask_or_positions_wrong_at_one_counter_value_is_refused(monkeypatch, case):
    bad = 57

    def mask_at(p):
        m = _causal(p)
        if case == "one element at one position" and p == bad:
            m = m.clone()
            m[2, 3] = False
        return m

    def pos_at(p):
        w = _pos(p)
        if p == bad and case == "positions not ending at the largest":
            w = w.flip(0)
        if p == bad and case == "a position past the cache":
            w = w + L
        if p == bad and case == "a negative position":
            w = w - 100
        return w

    assert _proof(monkeypatch, mask_at, pos_at) is None


def test_proof_positions_stay_within_an_element_budget_at_long_caches():
    """Every position up to PROOF_ALL rows; beyond, the first and last rows and a spread between,
    fewer at longer caches so that a proof evaluates at most about PROOF_ELEMENTS mask elements
    (2**21 rows took 12.7 s with the 1792 positions of a 32768-row cache)."""
    assert mask_proofs.proof_positions(96) == list(range(96))
    for length in (1 << 13, 1 << 15, 1 << 17, 1 << 18, 1 << 20):
        ps = mask_proofs.proof_positions(length)
        assert ps == sorted(set(ps)) and 0 <= ps[0] and ps[-1] == length - 1
        assert ps[:16] == list(range(16)) and ps[-16:] == list(range(length - 16, length))
        if length > 1 << 17:
            assert len(ps) * length <= 1.01 * mask_proofs.PROOF_ELEMENTS
        else:
            assert len(ps) <= 1792
        gaps = max(b - a for a, b in zip(ps, ps[1:]))
        assert gaps <= 2 * length // min(512, len(ps) // 4)   # no stretch of the cache left unchecked
    assert len(mask_proofs.proof_positions(1 << 20)) < 300


def test_a_cache_longer_than_fusecs_longest_is_refused_clearly():
    """A cache above MAX_CACHE_LEN rows: the capacity falls back with a line naming the limit
    (before: a 2**21 capacity built in 20 s, 2**24 in 305 s and 5.7 GB); a step built again for a
    longer cache doubles at most up to the limit."""
    from fusec.config import MAX_CACHE_LEN
    from fusec.errors import FallbackRequired
    from fusec.frontend import symbolic
    assert symbolic.capacity(None, MAX_CACHE_LEN) == MAX_CACHE_LEN
    assert symbolic.capacity(None, symbolic.doubled(MAX_CACHE_LEN // 2 + 1)) == MAX_CACHE_LEN
    assert symbolic.capacity(None, symbolic.doubled(1000)) == max(2048, symbolic.capacity(None, 1))
    with pytest.raises(FallbackRequired, match="longer than fusec's longest, 1048576"):
        symbolic.capacity(None, MAX_CACHE_LEN + 1)
    with pytest.raises(FallbackRequired, match="longer than fusec's longest"):
        symbolic.capacity(None, symbolic.doubled(MAX_CACHE_LEN + 1))


def _window_proof(monkeypatch, length: int, window: int | None, hole: int | None = None):
    """causal_below over a one-row bool mask of ``length`` rows whose value at counter value p
    is HF's sliding-window mask ``p - window < row <= p`` (``window`` None: causal), with one
    wrong element at position ``hole``."""
    monkeypatch.setattr(position, "only_counter", lambda dep, g, t, ctrs: "c")
    monkeypatch.setattr(mask_proofs, "_length_as_value", lambda g, t: False)
    ar = torch.arange(length)

    def evaluate_many(g, names, c, ps, weights):
        p = torch.tensor(ps)[:, None]
        m = (ar[None, :] <= p) & ((ar[None, :] > p - window) if window else True)
        if hole in ps:
            m[ps.index(hole), 0] = ~m[ps.index(hole), 0]
        return {"mask": m}
    monkeypatch.setattr(position, "evaluate_many", evaluate_many)
    g = NS(tensors={"mask": NS(dtype=torch.bool, shape=(1, 1, 1, length), numel=length)}, batch=lambda: 1)
    return mask_proofs.causal_below(g, "mask", None, None, None, length)


@pytest.mark.parametrize("window", [2047, 4096, 777, 1024, 5000])
def test_a_window_mask_is_causal_below_its_window_at_a_long_capacity(monkeypatch, window):
    """At a 32768-row capacity (positions sampled past 1024), a window W anywhere, on the
    sampling grid or not, is proven causal exactly below W (the first non-causal position is
    searched between the last sampled causal one and the first sampled one that is not)."""
    assert _window_proof(monkeypatch, 32768, window) == ("c", window)


def test_a_mask_wrong_at_one_position_is_causal_only_below_it(monkeypatch):
    assert _window_proof(monkeypatch, 4096, None) == ("c", 4096)
    assert _window_proof(monkeypatch, 4096, 1000, hole=500) == ("c", 500)
    assert _window_proof(monkeypatch, 4096, 1000, hole=0) == (None, 0)
