"""The fusec IR: a DAG of typed ops over typed tensors.

A :class:`Graph` holds named :class:`TensorInfo` records (shape, dtype, role) and a list of
:class:`Op` in program order. Each op reads and writes tensors through named *slots*
(``op.inputs["x"] = "add_9"``). Three levels of op kinds live in the same IR:

* ``aten.*`` ops straight from capture (``op.attrs["target"]`` is the ``OpOverload`` and
  ``op.attrs["args"]``/``["kwargs"]`` hold the call with :class:`Ref` placeholders);
* semantic ops raised by ``normalize`` (``rmsnorm``, ``linear``, ``rope``, ``attention`` ...);
* instruction kinds produced by ``fuse`` (``rms_qkv_rope``, ``matvec_residual`` ...).

Byte-preserving views do not become ops: a tensor may be an *alias* of another tensor
(``alias_of``) with its own shape over the same contiguous bytes.

In-place writes (KV-cache appends, position counters) name the written buffer among the op's
outputs under a slot listed in ``op.mutates``; ordering of
such writes against earlier readers (write-after-read) is part of :meth:`Graph.dag`.
See docs/ir.md.
"""
from __future__ import annotations

import dataclasses
import math
import enum
from typing import TYPE_CHECKING, Any, Iterable

import torch

from fusec.errors import IRError

if TYPE_CHECKING:   # networkx is imported where a DAG is built: 0.5 s that a warm start never needs
    import networkx as nx


class Role(str, enum.Enum):
    """What a tensor is to the decode step."""

    INPUT = "input"            # graph input read each step (token ids)
    WEIGHT = "weight"          # parameter: read-only, never depends on other instructions
    KV_CACHE = "kv_cache"      # [batch, kv_heads, max_len, head_dim], written in place
    STATE = "state"            # small mutable graph input (position counter)
    CONSTANT = "constant"      # value known at compile time (folded tables)
    INTERMEDIATE = "intermediate"
    OUTPUT = "output"


@dataclasses.dataclass(frozen=True)
class Ref:
    """Placeholder for a tensor argument inside an ATen call template."""

    slot: str


@dataclasses.dataclass
class TensorInfo:
    """A typed tensor of the IR.

    Attributes:
        name: unique name in the graph.
        shape: static shape (elements per dim).
        dtype: torch dtype of the elements.
        role: see :class:`Role`.
        input_index: position in the flat graph inputs, or None.
        alias_of: name of the tensor whose bytes this one reinterprets (contiguous reshape).
        offset: None for an alias of all of ``alias_of``'s bytes (the same number of elements);
            an int for a *view*: this tensor's elements are the contiguous ones starting
            ``offset`` elements into ``alias_of``'s bytes (both of one element size; rows
            ``[r0, r1)`` of a weight ``[N, K]`` are the view ``[r1 - r0, K]`` at ``r0 * K``).
            :meth:`Graph.span` gives the flat range of the root buffer a tensor covers.
        value: the value of a CONSTANT tensor (a torch.Tensor on the CPU).
        sym: dims whose size is a run-time length, dim index -> the length's symbol (dynamo's
            name, e.g. ``"s38"``): the KV cache's rows and a mask over them in a
            length-polymorphic graph (:attr:`Graph.lengths`). ``shape`` holds the symbol's
            capacity there; a call passes any size from 1 up to it.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: Role = Role.INTERMEDIATE
    input_index: int | None = None
    alias_of: str | None = None
    value: torch.Tensor | None = None
    sym: dict[int, str] = dataclasses.field(default_factory=dict)
    offset: int | None = None

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * self.dtype.itemsize

    def describe(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        extra = f" ={self.alias_of}" if self.alias_of else ""
        if self.alias_of and self.offset is not None:
            extra += f"+{self.offset}"
        dims = ",".join(f"{self.sym[i]}<={d}" if i in self.sym else str(d) for i, d in enumerate(self.shape))
        return f"{dt}[{dims}] {self.role.value}{extra}"


@dataclasses.dataclass
class Op:
    """One op of the IR.

    Attributes:
        name: unique op name.
        kind: ``aten.<op>.<overload>``, a semantic kind, or an instruction kind.
        inputs: slot -> tensor name read.
        outputs: slot -> tensor name written. A fresh tensor, or (for slots in ``mutates``)
            an existing buffer updated in place.
        attrs: kind-specific attributes (literals, the ATen call template, shapes).
        mutates: output slots that write an existing buffer in place.
        source: ``file:line code`` of the model code that produced the op (for errors).
        layer: decoder layer index, when known.
    """

    name: str
    kind: str
    inputs: dict[str, str]
    outputs: dict[str, str]
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    mutates: tuple[str, ...] = ()
    source: str = ""
    layer: int | None = None

    def reads(self) -> list[str]:
        return list(self.inputs.values())

    def writes(self) -> list[str]:
        return list(self.outputs.values())

    def fresh_outputs(self) -> list[str]:
        return [t for s, t in self.outputs.items() if s not in self.mutates]

    def describe(self) -> str:
        ins = ", ".join(f"{k}={v}" for k, v in self.inputs.items())
        outs = ", ".join(f"{k}={v}" for k, v in self.outputs.items())
        shown = {k: v for k, v in self.attrs.items() if k not in ("target", "args", "kwargs", "group", "ops", "pre")}
        at = " " + " ".join(f"{k}={_fmt(v)}" for k, v in shown.items()) if shown else ""
        lay = f" L{self.layer}" if self.layer is not None else ""
        return f"{self.name}: {self.kind}({ins}) -> ({outs}){at}{lay}"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, (list, tuple)) and len(v) > 8:
        return f"[{len(v)} items]"
    return str(v)


class Graph:
    """A decode-step graph: tensors, ops in program order, graph inputs and outputs.

    ``inputs`` lists tensor names in the order of the flat runtime arguments;
    ``outputs`` lists the tensors returned, in order.

    ``skip_args``: positions of the flat runtime arguments that are not inputs of the step (the
    integer sizes a symbolic graph takes, ``Sym(s38)``); the caller drops them before calling.
    ``lengths``: the run-time lengths of a length-polymorphic graph, symbol -> capacity (the
    size every ``TensorInfo.sym`` dim of that symbol has in the graph); empty for a graph of
    static shapes. See docs/ir.md, "Run-time lengths".
    ``batch_size`` and ``query_len``: the decode step's B sequences and K query tokens each,
    recorded when the graph is built (:meth:`record_rows`, from the attention queries of the
    captured step) and kept by every pass and copy, whatever the passes make of the attention
    ops; 1 and 1 for a graph built otherwise (:meth:`batch`, :meth:`query_tokens`, :meth:`rows`).
    """

    def __init__(self) -> None:
        self.tensors: dict[str, TensorInfo] = {}
        self.ops: list[Op] = []
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.skip_args: list[int] = []
        self.lengths: dict[str, int] = {}
        self.batch_size: int = 1
        self.query_len: int = 1
        self._names: set[str] = set()

    # -- construction -------------------------------------------------------------------
    def add_tensor(self, info: TensorInfo) -> TensorInfo:
        if info.name in self.tensors:
            raise IRError(f"tensor {info.name!r} defined twice")
        self.tensors[info.name] = info
        self._names.add(info.name)
        return info

    def fresh_name(self, base: str) -> str:
        name, i = base, 0
        while name in self._names or name in self.tensors:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    def new_tensor(self, base: str, shape: Iterable[int], dtype: torch.dtype,
                   role: Role = Role.INTERMEDIATE, **kw: Any) -> str:
        name = self.fresh_name(base)
        self.tensors[name] = TensorInfo(name, tuple(int(s) for s in shape), dtype, role, **kw)
        return name

    # -- queries ------------------------------------------------------------------------
    def root(self, name: str) -> str:
        """Follow ``alias_of`` links to the tensor that owns the bytes."""
        seen = 0
        while self.tensors[name].alias_of is not None:
            name = self.tensors[name].alias_of
            seen += 1
            if seen > 10_000:
                raise IRError(f"alias cycle at {name}")
        return name

    def span(self, name: str) -> tuple[str, int, int]:
        """``(root, start, stop)``: the flat elements ``[start, stop)`` of the root buffer (in
        the root's elements) that ``name`` covers. A whole-buffer alias covers all of its root;
        a view (``TensorInfo.offset`` set) its own elements from its offset on, offsets of views
        of views adding up."""
        info = self.tensors[name]
        if info.alias_of is None:
            return name, 0, info.numel
        off_bytes, t, partial = 0, info, False
        while t.alias_of is not None:
            if t.offset is not None:
                off_bytes += t.offset * t.dtype.itemsize
                partial = True
            t = self.tensors[t.alias_of]
        root = self.root(name)
        if not partial:
            return root, 0, self.tensors[root].numel
        item = self.tensors[root].dtype.itemsize
        start = off_bytes // item
        return root, start, start + info.nbytes // item

    def is_view(self, name: str) -> bool:
        """Whether ``name`` covers part of its root buffer only (an offset view, or an alias of one)."""
        root, start, stop = self.span(name)
        return root != name and (start, stop) != (0, self.tensors[root].numel)

    def producers(self) -> dict[str, Op]:
        """Root tensor name -> the op that creates it (fresh outputs only)."""
        out: dict[str, Op] = {}
        for op in self.ops:
            for t in op.fresh_outputs():
                out[self.root(t)] = op
        return out

    def users(self) -> dict[str, list[Op]]:
        """Root tensor name -> ops that read it, in program order."""
        out: dict[str, list[Op]] = {}
        for op in self.ops:
            for t in set(self.root(x) for x in op.reads()):
                out.setdefault(t, []).append(op)
        return out

    def dag(self) -> nx.DiGraph:
        """Dependency DAG over op names: read-after-write, write-after-read, write-after-write.

        Edges follow program order on root buffers, so in-place writes (KV cache, position
        counters) are ordered after every earlier reader.
        """
        import networkx as nx
        g = nx.DiGraph()
        last_write: dict[str, str] = {}
        readers: dict[str, list[str]] = {}
        for op in self.ops:
            g.add_node(op.name)
            for t in {self.root(x) for x in op.reads()}:
                if t in last_write:
                    g.add_edge(last_write[t], op.name)
            for slot, t in op.outputs.items():
                r = self.root(t)
                for rd in readers.get(r, []):
                    if rd != op.name:
                        g.add_edge(rd, op.name)
                if r in last_write and last_write[r] != op.name:
                    g.add_edge(last_write[r], op.name)
            for t in {self.root(x) for x in op.reads()}:
                readers.setdefault(t, []).append(op.name)
            for t in op.outputs.values():
                r = self.root(t)
                last_write[r] = op.name
                readers[r] = []
        return g

    def op_by_name(self) -> dict[str, Op]:
        return {op.name: op for op in self.ops}

    def count_kinds(self, members: bool = True) -> dict[str, int]:
        """Ops per kind as they compute: a ``chain`` op's member ops counted by their own kinds
        (the chain not at all), a folded prologue's members (``pre``) beside the op that runs
        them; ``members=False``: the graph's own ops (a chain as one, a prologue not at all)."""
        out: dict[str, int] = {}
        for op in self.ops:
            ops = [op]
            if members:
                ops = op.attrs["ops"] if op.kind == "chain" else [*op.attrs.get("pre", ()), op]
            for o in ops:
                out[o.kind] = out.get(o.kind, 0) + 1
        return dict(sorted(out.items()))

    def _queries(self) -> list[tuple[int, ...]]:
        """The shapes of the step's attention queries (``attention`` and ``fusec.sdpa`` ops'
        ``q``) that are [B, Hq, K, D], for :meth:`record_rows` (before ``fuse`` makes the
        attention another kind's op)."""
        shapes = []
        for op in self.ops:
            q = None
            if op.kind == "attention":
                q = op.inputs.get("q")
            elif op.kind == "fusec.sdpa.default" and isinstance(op.attrs.get("args", (None,))[0], Ref):
                q = op.inputs.get(op.attrs["args"][0].slot)
            if q is not None and len(self.tensors[q].shape) == 4:
                shapes.append(tuple(int(d) for d in self.tensors[q].shape))
        return shapes

    def record_rows(self) -> None:
        """Record the step's B and K (:attr:`batch_size`, :attr:`query_len`) off its attention
        queries ([B, Hq, K, D]: the largest dim 0 and dim 2 of the ``fusec.sdpa`` and ``attention``
        ops' ``q``; 1 and 1 without attention). Called once where the graph is built
        (:func:`fusec.frontend.from_fx.graph_from_aten`), before any pass rewrites the attention
        into a kind of its own; the capture accepts a step only where every query has a fixed B
        and K (:func:`fusec.frontend.capture.check_decode_step`)."""
        shapes = self._queries()
        self.batch_size = max([s[0] for s in shapes], default=1)
        self.query_len = max([s[2] for s in shapes], default=1)

    def batch(self) -> int:
        """The decode step's batch B (:attr:`batch_size`, recorded when the graph was built:
        :meth:`record_rows`); docs/batch.md."""
        return self.batch_size

    def query_tokens(self) -> int:
        """K, the query tokens per sequence of the step (:attr:`query_len`, recorded when the
        graph was built: :meth:`record_rows`): 1 for a decode step, K > 1 for speculative
        decoding's verification of K draft tokens; docs/batch.md."""
        return self.query_len

    def rows(self) -> int:
        """The step's activation rows ``B * K`` (sequences times query tokens each): the rows of
        a ``linear``'s x, of the hidden states. An instruction kind takes a step only where its
        ``max_rows`` is at least this (:class:`fusec.instructions.base.Instruction`, the ``fuse``
        pass); 1 for a graph without attention."""
        return self.batch_size * self.query_len

    # -- checking and printing ----------------------------------------------------------
    def check(self, stage: str = "") -> None:
        """Raise :class:`IRError` naming ``stage`` if an invariant does not hold.

        Invariants: every read tensor is defined before use (graph input, constant, weight,
        or an earlier op's output); each fresh tensor is created once; aliases point at
        existing tensors with the same number of elements (a view, ``offset`` set: of the same
        element size, fitting in them); outputs exist; names are unique.
        """
        where = f" after pass {stage!r}" if stage else ""
        defined = set()
        for name, t in self.tensors.items():
            if t.role in (Role.INPUT, Role.WEIGHT, Role.KV_CACHE, Role.STATE, Role.CONSTANT):
                defined.add(name)
            if t.alias_of is not None:
                if t.alias_of not in self.tensors:
                    raise IRError(f"tensor {name} aliases unknown {t.alias_of}{where}")
                base = self.tensors[t.alias_of]
                if t.offset is not None:
                    if t.dtype.itemsize != base.dtype.itemsize or t.offset < 0 or t.sym or \
                            t.offset + t.numel > base.numel:
                        raise IRError(f"view {name} {t.dtype}{list(t.shape)} at offset {t.offset} does not fit in "
                                      f"{t.alias_of} {base.dtype}{list(base.shape)}{where}")
                elif base.numel != t.numel:
                    raise IRError(f"alias {name} {t.shape} has another size than "
                                  f"{t.alias_of} {self.tensors[t.alias_of].shape}{where}")
        seen_ops = set()
        for op in self.ops:
            if op.name in seen_ops:
                raise IRError(f"op name {op.name} used twice{where}")
            seen_ops.add(op.name)
            for slot, t in op.inputs.items():
                if t not in self.tensors:
                    raise IRError(f"{op.name} ({op.kind}) reads unknown tensor {t} in slot {slot}{where}")
                if self.root(t) not in defined:
                    raise IRError(f"{op.name} ({op.kind}) reads {t} before it is written{where}"
                                  f"{' [' + op.source + ']' if op.source else ''}")
            for slot, t in op.outputs.items():
                if t not in self.tensors:
                    raise IRError(f"{op.name} writes unknown tensor {t}{where}")
                if slot in op.mutates:
                    if self.root(t) not in defined:
                        raise IRError(f"{op.name} mutates {t} before it exists{where}")
                else:
                    if self.root(t) in defined and self.tensors[self.root(t)].role not in (Role.OUTPUT,):
                        raise IRError(f"{op.name} ({op.kind}) re-defines {t}{where}")
                    defined.add(self.root(t))
        for t in self.outputs:
            if t not in self.tensors or self.root(t) not in defined:
                raise IRError(f"graph output {t} is never written{where}")

    def dump(self) -> str:
        """Readable text: inputs, ops one per line with types of their outputs, outputs."""
        lines = ["# inputs"]
        if self.rows() > 1:
            lines.insert(0, f"# batch {self.batch_size}, query tokens {self.query_len}")
        if self.lengths:
            lines.insert(0, "# run-time lengths (symbol <= capacity): " +
                         ", ".join(f"{k}<={v}" for k, v in self.lengths.items()))
        for n in self.inputs:
            lines.append(f"  {n}: {self.tensors[n].describe()}")
        views = [t for t in self.tensors.values() if t.offset is not None]
        if views:   # views at an offset into a buffer (TensorInfo.offset): no op defines them
            lines.append("# views")
            for t in views:
                lines.append(f"  {t.name}: {t.describe()}")
        consts = [t for t in self.tensors.values() if t.role == Role.CONSTANT]
        if consts:
            lines.append("# constants")
            for t in consts:
                lines.append(f"  {t.name}: {t.describe()}")
        lines.append("# ops")
        for op in self.ops:
            types = "; ".join(f"{t}: {self.tensors[t].describe()}" for t in op.writes())
            lines.append(f"  {op.describe()}    # {types}")
        lines.append("# outputs")
        lines.append("  " + ", ".join(self.outputs))
        return "\n".join(lines) + "\n"

    def copy(self) -> "Graph":
        g = Graph()
        g.tensors = {k: dataclasses.replace(v, sym=dict(v.sym)) for k, v in self.tensors.items()}
        g.ops = [dataclasses.replace(o, inputs=dict(o.inputs), outputs=dict(o.outputs),
                                     attrs=dict(o.attrs)) for o in self.ops]
        g.inputs = list(self.inputs)
        g.outputs = list(self.outputs)
        g.skip_args = list(self.skip_args)
        g.lengths = dict(self.lengths)
        g.batch_size, g.query_len = self.batch_size, self.query_len
        g._names = set(self._names)
        return g
