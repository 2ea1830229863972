"""Proofs about an attention's mask by evaluation: what a mask that depends only on a position
counter is, at every counter value a cache can hold (:func:`proof_positions`).

- :func:`causal_counter`: the mask is the causal mask ``row <= p`` (one row, or a batch's row
  per sequence): the attention drops it and reads rows ``0 .. p``;
- :func:`token_positions`: a K-token step's mask row k is ``row <= pos[k]`` for the K write
  positions ``pos``: the attention takes the positions as its mask (``mask_kind``
  :data:`~fusec.ir.semantics.TOKEN_POSITIONS`);
- :func:`bounded_by_positions`: a mask that stays (a padded batch's) is the AND of terms, one of
  which attends no row past the last write position: the attention reads rows up to it only.

Each evaluates the mask's ops (:func:`fusec.ir.position.evaluate_many`) in chunks of about 16M
mask elements; a mask whose ops use the cache's run-time length as a value is never proven (a
proof at one length would not cover the others). Used by :mod:`fusec.passes.recognize`.
"""
from __future__ import annotations

import torch

from fusec.ir import Graph, position

#: cache lengths up to this have their mask checked at every position
PROOF_ALL = 4096
#: beyond PROOF_ALL, the most mask elements (positions x cache rows) a proof evaluates: fewer
#: positions at longer caches (1792 positions up to 2**17 rows; at 2**20, 256 positions: the
#: proof took 12.7 s of a 20 s compile at 2**21 rows on a 2-core CPU with 1792)
PROOF_ELEMENTS = 1 << 28


def proof_positions(length: int) -> list[int]:
    """The positions at which a mask is checked to be causal over all ``length`` rows: every one
    up to :data:`PROOF_ALL`; beyond, the first 1024, the last 256 and 512 spread between (a
    mask that differs from causal only past a window or within chunks shows at the last rows;
    checking all of a 32768-row capacity would evaluate 10^9 elements), each of the three
    scaled down (at least 16) where they would evaluate more than :data:`PROOF_ELEMENTS`."""
    if length <= PROOF_ALL:
        return list(range(length))
    scale = min(1.0, PROOF_ELEMENTS / (1792 * length))
    first, last, spread = (max(16, int(n * scale)) for n in (1024, 256, 512))
    return sorted(set(range(first)) | set(range(length - last, length))
                  | set(range(0, length, max(1, length // spread))))


def _length_as_value(g: Graph, t: str) -> bool:
    """Whether ``t``'s ops use the cache's run-time length as a value (not only as a size): then
    no proof at the capacity covers the other lengths."""
    return bool(g.lengths) and any(op.attrs.get("symbolic") and not position.sizes_only(op)
                                   for op in position.subgraph_ops(g, t))


def _chunks(positions: list[int], numel: int):
    """``positions`` in chunks of about 16M evaluated elements of a tensor of ``numel``."""
    step = max(1, (1 << 24) // (numel or 1))
    return (positions[i:i + step] for i in range(0, len(positions), step))


def causal_counter(g: Graph, mask: str, dep, ctrs, weights, length: int) -> str | None:
    """The position counter for which ``mask`` (over an attention's ``length`` cache rows) is the
    causal mask ``row <= p`` at every position ``p`` in ``[0, length)``, or None. Those are the
    positions at which the step can write its row into that cache (the attention kinds read
    rows ``0..p``): a sliding-window layer's cache of W rows, before its window is full, sees
    positions below W only, where its window mask (``p - W < row <= p``) is causal. The mask is
    one row for every head (``length`` elements), or ``[B, 1, 1, length]`` for a batch of B
    sequences (HF's mask of a batch: one row per sequence, all of them causal when no prompt is
    padded); evaluated in chunks of about 16M mask elements."""
    c, below = causal_below(g, mask, dep, ctrs, weights, length, search=False)
    return c if below == length else None


def causal_below(g: Graph, mask: str, dep, ctrs, weights, length: int,
                 search: bool = True) -> tuple[str | None, int]:
    """``(c, P)``: the position counter ``c`` on which ``mask`` (over ``length`` cache rows)
    depends alone, and the count ``P`` of positions ``[0, P)`` at which it is the causal mask
    ``row <= p`` (:func:`causal_counter`: ``P == length``); ``(None, 0)`` where there is no such
    counter or the mask is not causal at position 0. A sliding-window layer's mask at a cache
    length of run-time size, evaluated at the capacity: causal below its window W, so ``P`` is W,
    which bounds that cache's rows (HF's sliding layer has at most W) and its positions. The
    positions checked are :func:`proof_positions` of ``length``; where one is not causal, every
    position between it and the checked one before it (the first that is not: ``P``), then
    :func:`proof_positions` of ``P`` again (``search`` False: ``(None, 0)`` at once)."""
    info = g.tensors[mask]
    c = position.only_counter(dep, g, mask, ctrs)
    if c is None or info.shape[-1] != length:
        return None, 0
    if info.numel != length and (len(info.shape) != 4 or info.shape[0] != g.batch()
                                 or tuple(info.shape[1:]) != (1, 1, length)):
        return None, 0
    if _length_as_value(g, mask):
        return None, 0
    positions = proof_positions(length)
    first = _first_not_causal(g, mask, c, weights, positions, length)
    if first is None:
        return c, length
    if not search:
        return None, 0
    k = positions.index(first)   # the first position that is not lies after the last checked one that is
    gap = _first_not_causal(g, mask, c, weights, list(range(positions[k - 1] + 1 if k else 0, first)), length)
    first = first if gap is None else gap
    if first == 0 or _first_not_causal(g, mask, c, weights, proof_positions(first), length) is not None:
        return None, 0
    return c, first


def _first_not_causal(g: Graph, mask: str, c: str, weights, positions: list[int], length: int) -> int | None:
    """The first of ``positions`` (ascending) at which ``mask`` is not the causal mask, or None."""
    ar = torch.arange(length)
    numel = g.tensors[mask].numel
    for ps in _chunks(positions, numel):
        m = position.evaluate_many(g, [mask], c, ps, weights)[mask].reshape(len(ps), -1, length)   # a row per sequence
        want = (ar[None, :] <= torch.tensor(ps)[:, None])[:, None, :].expand_as(m)
        if m.dtype == torch.bool:
            ok = (m == want).flatten(1).all(1)
        elif m.is_floating_point():   # masked rows -inf, or the dtype's lowest (HF's eager mask): softmax
            low = torch.finfo(m.dtype).min   # gives them weight 0 either way, as every row keeps its visible row p
            ok = torch.where(want, m == 0, m <= low).flatten(1).all(1)
        else:
            return ps[0]
        if not bool(ok.all()):
            return ps[int((~ok).nonzero()[0])]
    return None


def token_positions(g: Graph, mask: str, dep, ctrs, weights, length: int) -> str | None:
    """For the bool ``mask`` [1 or B, 1, K, length] of a step of K > 1 query tokens: a tensor of
    the K write positions (a ``kv_write``'s ``pos``, int64) such that, for every value of the
    position counter both depend on, every sequence's mask row k is ``arange(length) <= pos[k]``
    (HF's causal mask over a static cache for the K new tokens, ``kv_idx <= q_idx``; a batch
    without padding repeats it per sequence) and ``pos[K - 1]`` is the largest position, checked
    at the counter values whose K rows fit the cache (:func:`proof_positions`, evaluated in
    chunks of about 16M mask elements); None if there is none. Every layer's attention then takes that tensor as its mask and its position
    (``mask_kind`` :data:`~fusec.ir.semantics.TOKEN_POSITIONS`; the layers' counters advance
    together, as at K = 1 where every layer reads the mask's counter): the mask's ops, which
    read the cache's length, leave the step, so one step serves every length."""
    info = g.tensors[mask]
    k = info.shape[2] if len(info.shape) == 4 else 0
    if info.dtype != torch.bool or len(info.shape) != 4 or info.shape[0] not in (1, g.batch()) \
            or tuple(info.shape[1:]) != (1, k, length) or not 2 <= k < length:
        return None
    c = position.only_counter(dep, g, mask, ctrs)
    if c is None:
        return None
    if _length_as_value(g, mask):
        return None
    cands = []
    for o in g.ops:
        if o.kind == "kv_write":
            wp = o.inputs["pos"]
            if wp not in cands and g.tensors[wp].dtype == torch.int64 and g.tensors[wp].numel == k \
                    and position.only_counter(dep, g, wp, ctrs) == c:
                cands.append(wp)
    positions = [p for p in proof_positions(length) if p + k <= length]
    ar = torch.arange(length)
    for wp in cands[:1]:   # the first layer's (only it shares the mask's counter: HF's cache_position)
        for ps in _chunks(positions, info.numel):   # every position of a chunk at once
            vals = position.evaluate_many(g, [mask, wp], c, ps, weights)
            w = vals[wp].reshape(len(ps), k).to(torch.int64)
            last = w[:, -1]
            # the last token's position the largest (the kinds read rows up to it), all inside
            if not (bool((w.min(1).values >= 0).all()) and torch.equal(w.max(1).values, last)
                    and bool((last < length).all())):
                return None
            m = vals[mask].reshape(len(ps), -1, k, length)
            if not torch.equal(m, (ar[None, None, :] <= w[:, :, None])[:, None].expand_as(m)):
                return None
        return wp
    return None


#: ops through which a mask's values pass unchanged (views, copies, a bool cast of a bool)
_SAME_VALUES = ("aten.expand.default", "aten.unsqueeze.default", "aten.view.default", "aten.reshape.default",
                "aten._unsafe_view.default", "aten.alias.default", "aten.clone.default", "aten._to_copy.default")
#: ops whose bool output is the AND of their two inputs (broadcast)
_ANDS = ("aten.bitwise_and.Tensor", "aten.logical_and.default")


def _and_terms(g: Graph, t: str) -> list[str]:
    """The terms of the bool tensor ``t`` as an AND: seen through :data:`_SAME_VALUES` ops, the
    inputs of every :data:`_ANDS` op, recursively (HF's ``and_masks``: the causal part AND the
    padding part); ``[t]`` when it is no AND. Each term broadcasts to ``t``'s shape, so ``t`` is
    True only where every term is."""
    prods = g.producers()
    terms, stack, seen = [], [t], set()
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        p = prods.get(g.root(x))
        while p is not None and p.kind in _SAME_VALUES and g.tensors[p.inputs["in0"]].dtype == torch.bool:
            x = p.inputs["in0"]
            p = prods.get(g.root(x))
        if p is not None and p.kind in _ANDS and all(g.tensors[v].dtype == torch.bool for v in p.inputs.values()):
            stack.extend(p.inputs.values())
        else:
            terms.append(x)
    return terms


def bounded_by_positions(g: Graph, mask: str, dep, ctrs, weights, length: int, k: int) -> str | None:
    """For the bool ``mask`` of a step of ``k`` query tokens per sequence (over an attention's
    ``length`` cache rows, any layout: one row, ``[B, 1, K, length]``): a tensor of the last row
    any query token may attend, or None. One of the mask's AND terms (:func:`_and_terms`; HF's
    mask of a padded batch is its causal part AND its padding part) depends only on a position
    counter and, at every counter value whose ``k`` rows fit the cache (:func:`proof_positions`),
    has no True past the bound's last element, which is the largest and inside the cache. The
    bound is that counter (``k`` 1: HF's ``cache_position``, as :func:`causal_counter` gives) or
    the first ``kv_write`` position of ``k`` rows that depends on it (as :func:`token_positions`).
    The attention then reads rows up to the bound's last element under the mask: the rows past
    it, which the mask gives weight 0, are not read (attr ``mask_bound``)."""
    if g.tensors[mask].dtype != torch.bool:
        return None
    positions = [p for p in proof_positions(length) if p + k <= length]
    for term in _and_terms(g, mask):
        t = g.tensors[term]
        c = position.only_counter(dep, g, term, ctrs)
        if t.dtype != torch.bool or not t.shape or t.shape[-1] != length or c is None:
            continue
        if _length_as_value(g, term):
            continue
        bound = c if k == 1 else next(
            (o.inputs["pos"] for o in g.ops if o.kind == "kv_write" and g.tensors[o.inputs["pos"]].numel == k
             and g.tensors[o.inputs["pos"]].dtype == torch.int64
             and position.only_counter(dep, g, o.inputs["pos"], ctrs) == c), None)
        if bound is not None and _no_row_past(g, term, bound, c, positions, weights, length):
            return bound
    return None


def _no_row_past(g: Graph, term: str, bound: str, c: str, positions: list[int], weights, length: int) -> bool:
    """``term`` has no True at a row past ``bound[-1]``, which is the largest of ``bound`` and
    inside ``[0, length)``, at every counter value of ``positions`` (``bound`` the counter
    ``c`` itself: its value; chunks of about 16M elements)."""
    ar = torch.arange(length)
    for ps in _chunks(positions, g.tensors[term].numel):
        vals = position.evaluate_many(g, [term] if bound == c else [term, bound], c, ps, weights)
        w = torch.tensor(ps)[:, None] if bound == c else vals[bound].reshape(len(ps), -1).to(torch.int64)
        last = w[:, -1]
        if not (bool((w.min(1).values >= 0).all()) and torch.equal(w.max(1).values, last) and bool((last < length).all())):
            return False
        m = vals[term].reshape(len(ps), -1, length)
        if bool((m & (ar[None, None, :] > last[:, None, None])).any()):
            return False
    return True


def without_causal_term(g: Graph, mask: str, c: str, dep, ctrs, weights, length: int) -> str | None:
    """For a bool ``mask`` (over ``length`` cache rows, one query token per sequence) that
    :func:`bounded_by_positions` bounds by the counter ``c``: the mask without its causal term,
    or None. One of its AND terms (:func:`_and_terms`) must be exactly the causal mask
    ``row <= p`` on ``c`` at every position (:func:`causal_counter`: HF's causal part, or the
    bound a caller ANDs onto a mask it passes, :func:`fusec.frontend.mask_bound.causal_bound`),
    and the others one tensor of the mask's own shape (the 4-D mask generate() passes, a
    padded batch's). Over the rows ``0 .. p`` that the bounded attention reads, the causal term
    is all True, so the other term gives the same values there: the attention reads it instead,
    and the AND and the causal term's ops leave the step (dead code)."""
    terms = _and_terms(g, mask)
    if len(terms) != 2:
        return None
    shape = g.tensors[mask].shape
    for causal, other in (terms, terms[::-1]):
        t = g.tensors[other]
        if t.dtype == torch.bool and t.shape == shape and other != mask \
                and causal_counter(g, causal, dep, ctrs, weights, length) == c:
            return other
    return None
