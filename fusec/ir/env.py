"""Tensor storage for executing the IR on the CPU (reference executor and simulator).

Every root buffer lives once in :class:`Env`; aliases are reshaped views of their root (a
view at an offset, ``TensorInfo.offset``: its own elements of the root's flat storage).
Fresh output buffers are allocated poisoned (NaN for floats, a sentinel for integers) so a
region that no instruction writes shows up in the results.

Run-time lengths (a length-polymorphic graph, :attr:`fusec.ir.Graph.lengths`): the size of each
symbol is learnt from the inputs (the KV caches and masks a call passes, any size up to the
capacity); :meth:`Env.shape` is a tensor's shape with its symbolic dims at those sizes, and an
alias is read in that shape. Fresh buffers never have symbolic dims.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch

from fusec.errors import FusecError
from fusec.ir import Graph, Role

POISON_INT = -(2 ** 31) + 7


class Env:
    """Maps the graph's root tensors to torch tensors.

    Args:
        g: the graph.
        flat_args: runtime tensors in ``g.inputs`` order (KV caches and states are used in
            place, so writes reach the caller's tensors).
    """

    def __init__(self, g: Graph, flat_args: list[Any], device: torch.device | None = None):
        self.g = g
        self.device = device  # if set, ops that create tensors create them here
        self.bufs: dict[str, torch.Tensor] = {}
        # atomic tickets (the GPU keeps them in spare counters): key -> value, and the order in
        # which instructions took them; the simulator sets ``current`` to the running instruction
        self.tickets: dict[Any, int] = {}
        self.ticket_log: list[tuple[Any, int | None]] = []
        self.current: int | None = None
        #: what one op computes whole for all its tiles, once per step (op name -> value): a
        #: ranged generic op's full output, a folded prologue's staged vector. An op's inputs do
        #: not change while its tiles run (its readers' writers wait for all of them), so every
        #: tile would compute the same
        self.memo: dict[str, Any] = {}
        #: run-time size of each length symbol (from the inputs; the capacity when no input has it)
        self.lengths: dict[str, int] = {}
        seen: dict[str, str] = {}   # symbol -> the input its size came from
        for name, a in zip(g.inputs, flat_args):
            role = g.tensors[name].role
            if role in (Role.KV_CACHE, Role.STATE) and isinstance(a, torch.Tensor) and not a.is_contiguous():
                raise FusecError(f"input {name} ({role.value}, shape {list(a.shape)}): not contiguous (strides "
                                 f"{list(a.stride())}); the step writes it in place as one contiguous buffer: "
                                 f"store the cache's tensors contiguous")
            self.bufs[name] = a
            for dim, sym in g.tensors[name].sym.items():
                n = int(a.shape[dim])
                if sym in self.lengths and self.lengths[sym] != n:
                    raise FusecError(f"run-time length {sym}: input {seen[sym]} has {self.lengths[sym]} rows, "
                                     f"input {name} has {n} (dim {dim}); every tensor of one length must agree")
                self.lengths[sym], seen[sym] = n, name
        for t in g.tensors.values():
            if t.role == Role.CONSTANT and t.alias_of is None:
                v = t.value   # a graph constant made on the model's device (HF's eager mask: torch.tensor(0.0, device=...))
                self.bufs[t.name] = v.to(device) if device is not None and isinstance(v, torch.Tensor) else v

    def once(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per step for ``key`` (kept in :attr:`memo`): what every tile
        of an op computes alike from the op's inputs (a staged, normed vector)."""
        got = self.memo.get(key)
        if got is None:
            got = self.memo[key] = make()
        return got

    def take_ticket(self, key: Any) -> int:
        """Atomic fetch-and-add of the ticket ``key`` (0 at the start of a step): returns the
        old value and logs which instruction took it. The simulator orders what each taker
        does after its ticket (``Instruction.ticket_regions``) after the taker before it, as
        the GPU's acquire-release atomic does."""
        old = self.tickets.get(key, 0)
        self.tickets[key] = old + 1
        self.ticket_log.append((key, self.current))
        return old

    def peek_ticket(self, key: Any) -> int:
        """The ticket ``key``'s value without taking it."""
        return self.tickets.get(key, 0)

    def shape(self, name: str) -> tuple[int, ...]:
        """``name``'s shape at run time: its IR shape with each symbolic dim
        (:attr:`fusec.ir.TensorInfo.sym`) at its symbol's run-time size."""
        if not self.lengths:
            return tuple(self.g.tensors[name].shape)
        return tuple(self.length(name, d) for d in range(len(self.g.tensors[name].shape)))

    def length(self, name: str, dim: int) -> int:
        """The run-time size of dim ``dim`` of ``name`` (its IR size unless the dim is symbolic)."""
        info = self.g.tensors[name]
        syms = info.sym
        if not syms and info.alias_of is not None:   # an alias in its root's shape has the root's dims
            root = self.g.tensors[self.g.root(name)]
            syms = root.sym if tuple(root.shape) == tuple(info.shape) else {}
        sym = syms.get(dim)
        if sym is None:
            return int(info.shape[dim])
        return self.lengths.get(sym, self.g.lengths.get(sym, int(info.shape[dim])))

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` in its own shape (a view of its root when it is an alias; symbolic
        dims at their run-time sizes, :meth:`shape`)."""
        root = self.g.root(name)
        buf = self.bufs[root]
        if root == name:
            return buf
        if self.g.is_view(name):   # part of its root: its own elements from its offset on
            _, start, stop = self.g.span(name)
            return buf.reshape(-1)[start:stop].view(self.shape(name))
        return buf.reshape(self.shape(name))

    def flat(self, name: str) -> torch.Tensor:
        """A writable flat view of ``name``'s root buffer, allocated poisoned if missing (of
        ``name``'s own elements when it is a view of part of its root)."""
        root = self.g.root(name)
        if root not in self.bufs:
            info = self.g.tensors[root]
            fill = float("nan") if info.dtype.is_floating_point else POISON_INT
            if info.dtype == torch.bool:
                fill = True
            self.bufs[root] = torch.full(info.shape, fill, dtype=info.dtype)
        buf = self.bufs[root]
        if not buf.is_contiguous():
            raise RuntimeError(f"buffer {root} is not contiguous")
        if root != name and self.g.is_view(name):
            _, start, stop = self.g.span(name)
            return buf.view(-1)[start:stop]
        return buf.view(-1)

    @contextlib.contextmanager
    def scratch(self, roots: Iterable[str]) -> Iterator[None]:
        """Inside, ops may write the root buffers ``roots``; after, each is as it was before (gone,
        or its earlier values in the same tensor): what one tile computes for itself (a whole
        ranged op, a folded prologue's intermediates) reaches no other reader, as on the GPU."""
        saved = {r: (self.bufs[r], self.bufs[r].clone()) if r in self.bufs else (None, None) for r in roots}
        try:
            yield
        finally:
            for r, (buf, values) in saved.items():
                if buf is None:
                    self.bufs.pop(r, None)
                else:
                    self.bufs[r] = buf
                    buf.copy_(values)

    def set(self, name: str, value: torch.Tensor) -> None:
        """Store a whole-op result for the fresh tensor ``name``."""
        root = self.g.root(name)
        if root != name:
            self.flat(name).copy_(value.reshape(-1))
        else:
            self.bufs[name] = value
