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
