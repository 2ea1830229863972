"""kv_epilogue: the KV-cache rows a fused q/k/v projection computes, written by its own tiles.

GPT-2's attention (and any model whose fused q/k/v has no RoPE) computes q, k and v as one
product ``y`` (``c_attn``: a ``Conv1D``, ``matvec_cols``), splits it (``y.split(E, dim=2)``) and
appends k and v to the caches at the run-time position (``kv_write``). Standalone, the split
and the two writes are one ``chain`` on one SM, a dependency level of its own between the
projection and the attention. As the projection's epilogue, each tile stores the columns it
computes of the k (v) range into the cache's row at the position too, and the piece that
something else reads (q, by the attention) is a view of the product (``TensorInfo.offset``):
no op is left between the projection and the attention.

The rule (declared on ``matvec_cols``, :data:`RULE`): a ``matvec_cols`` op without residual,
activation or cache epilogue, batch 1, whose product is read only by piece ops
(:func:`fusec.ir.pieces.pieces`) over it or an alias of it, each output of which is one range
of the product and either read (through aliases) only as the ``val`` of one ``kv_write`` (one
query token: ``val`` holds the range's values in the cache's [Hkv, D] order, a cache
``[1, Hkv, L, D]`` of the product's dtype), or read by other ops (it becomes a view of the
product at the range's start), or read by nothing; one to :data:`MAX_CACHES` such writes, all
at one position, and no graph output among the pieces written. The fused op is the
``matvec_cols`` op with input ``kv_pos``, outputs ``cache0`` .. (in place: ``mutates``) and
attribute ``kv_cols`` (``[[c0, c1], ...]``: the product's columns of each cache, ``c1 - c0 =
Hkv * D``) and ``kv_head_dim`` (D).

Numerics are the product's: the value stored in the cache is the output's rounded value (the
split and ``index_put`` copy it). A position outside ``[0, L)`` is fault KV_POS (the tile writes
nothing, as ``rms_qkv_rope``). The caches' rows L may be a run-time length (one symbol for
all). Template: ``matvec_cols.cu.j2`` (``KV``, ``KC0``, ``KC1``, ``KVD``, ``KVN``).

Source: the QKV GEMM epilogues that store K and V into the paged cache in serving engines
(vLLM's, TensorRT-LLM's fused QKV/RoPE/cache kernels), here without RoPE and for a column-tiled
matvec.
"""
from __future__ import annotations

from fusec.abi import Fault
from fusec.ir import Graph, Op
from fusec.ir.env import Env
from fusec.ir.pieces import pieces
from fusec.instructions.base import Region
from fusec.instructions.call import Expr, Int, Ptr, Type
from fusec.instructions.rule import Ctx, Fusion, Rule

#: caches one op writes at most (the template's two pointers: K and V)
MAX_CACHES = 2


def caches(op: Op) -> list[tuple[str, int, int]]:
    """``[(cache tensor, c0, c1), ...]``: each cache ``op`` writes and the product's columns
    ``[c0, c1)`` that go into its row at the position; empty without the epilogue."""
    return [(op.outputs[f"cache{i}"], c0, c1) for i, (c0, c1) in enumerate(op.attrs.get("kv_cols", ()))]


def _readers(c: Ctx, t: str) -> list[Op]:
    return c.users.get(c.g.root(t), []) if t in c.g.tensors else []


def match(c: Ctx, p: Op) -> Fusion | None:
    """At a ``matvec_cols`` op: the fusion of the module docstring, or None."""
    g = c.g
    if "residual" in p.inputs or "act" in p.attrs or "kv_cols" in p.attrs or "pre" in p.attrs:
        return None
    out = p.outputs["out"]
    n = g.tensors[p.inputs["w"]].shape[1]
    root = g.root(out)
    if g.tensors[out].numel != n or root in {g.root(t) for t in g.outputs}:
        return None
    cuts = []
    for r in _readers(c, out):
        src = r.inputs.get("in0")
        got = pieces(g, r, n) if src is not None and g.root(src) == root else None
        if got is None or not all(rows.contiguous for rows, _ in got):
            return None
        cuts.append((r, got))
    writes, views, pos = [], [], None
    for r, got in cuts:
        for rows, t in got:
            users = _readers(c, t)
            kw = [u for u in users if u.kind == "kv_write" and g.root(u.inputs.get("val", "")) == g.root(t)]
            if kw and len(users) == 1:
                w = kw[0]
                cache = g.tensors[g.root(w.outputs["cache"])]
                if len(cache.shape) != 4 or cache.shape[0] != 1 or cache.shape[1] * cache.shape[3] != rows.size \
                        or g.tensors[w.inputs["val"]].numel != rows.size or cache.dtype != g.tensors[out].dtype \
                        or g.tensors[w.inputs["pos"]].numel != 1 or g.tensors[w.outputs["cache"]].numel != cache.numel:
                    return None
                if pos is not None and g.root(w.inputs["pos"]) != g.root(pos):
                    return None
                pos = w.inputs["pos"]
                writes.append((w, rows))
            elif users:
                if kw or g.root(t) in {g.root(x) for x in g.outputs}:
                    return None   # a cache row and something else: left alone
                views.append((t, rows))
    if not writes or len(writes) > MAX_CACHES:
        return None
    if len({cache_d(g, w) for w, _ in writes}) != 1:
        return None
    # the writes move to the last of them (the fused op's place): nothing between may use a cache
    inner = [p] + [r for r, _ in cuts] + [w for w, _ in writes]
    names = {o.name for o in inner}
    at = [i for i, o in enumerate(g.ops) if o.name in names]
    touched = {g.root(w.outputs["cache"]) for w, _ in writes}
    if any(g.root(t) in touched for o in g.ops[at[0]:at[-1]] if o.name not in names for t in o.reads() + o.writes()):
        return None

    def build() -> list[Op]:
        for t, rows in views:   # a piece something else reads: the product's range, in place
            info = g.tensors[t]
            info.alias_of, info.offset = out, rows.start
        outs = dict(p.outputs)
        for i, (w, _) in enumerate(writes):
            outs[f"cache{i}"] = w.outputs["cache"]
        attrs = dict(p.attrs, kv_cols=[[rows.start, rows.start + rows.size] for _, rows in writes],
                     kv_head_dim=cache_d(g, writes[0][0]))
        return [Op(p.name, p.kind, {**p.inputs, "kv_pos": pos}, outs, attrs,
                   tuple(p.mutates) + tuple(f"cache{i}" for i in range(len(writes))), p.source, p.layer)]
    return Fusion(inner, (out,) + tuple(t for t, _ in views), build)


def cache_d(g: Graph, w: Op) -> int:
    """The head dim D of the cache ``kv_write`` ``w`` writes."""
    return g.tensors[g.root(w.outputs["cache"])].shape[3]


#: the rule, on ``matvec_cols`` (after the rules that make its ops)
RULE = Rule(match=match, anchors=("matvec_cols",), priority=78)


def _heads(op: Op, c0: int, c1: int, k0: int, k1: int) -> list[tuple[int, int, int]]:
    """``[(head, d0, d1), ...]``: the cache head rows' elements ``[d0, d1)`` that the product's
    columns ``[c0, c1)`` hold of a cache whose range is ``[k0, k1)``."""
    d = op.attrs["kv_head_dim"]
    a, b = max(c0, k0) - k0, min(c1, k1) - k0
    return [(h, max(a, h * d) - h * d, min(b, (h + 1) * d) - h * d) for h in range(a // d, -(-b // d))] if b > a else []


def tile_regions(op: Op, g: Graph, c0: int, c1: int) -> tuple[list[Region], list[Region], int]:
    """(reads, writes, bytes) of the cache epilogue of the tile of columns ``[c0, c1)`` as
    planned: the position, and every row of each cache head whose columns it computes (the
    row depends on the run-time position: :func:`runtime_writes` narrows it)."""
    if "kv_cols" not in op.attrs:
        return [], [], 0
    reads, writes, nbytes = [Region.whole(g, op.inputs["kv_pos"])], [], 8
    d = op.attrs["kv_head_dim"]
    for cache, k0, k1 in caches(op):
        L = g.tensors[g.root(cache)].shape[2]
        for h, d0, d1 in _heads(op, c0, c1, k0, k1):
            writes.append(Region.of(g, cache, h * L * d, (h + 1) * L * d))
            nbytes += (d1 - d0) * g.tensors[cache].dtype.itemsize
    return reads, writes, nbytes


def _pos(op: Op, env: Env) -> int:
    """The run-time position, checked against the caches' rows (fault KV_POS as eager's
    IndexError)."""
    from fusec.ir.aten_exec import index_fault
    pos = int(env.read(op.inputs["kv_pos"]).reshape(-1)[0])
    L = env.length(op.outputs["cache0"], 2)
    if not 0 <= pos < L:
        raise index_fault(op, "KV-cache write position", pos, L, Fault.KV_POS)
    return pos


def runtime_writes(op: Op, env: Env, c0: int, c1: int) -> list[Region]:
    """The cache rows' elements the tile of columns ``[c0, c1)`` writes at this step's position."""
    if "kv_cols" not in op.attrs:
        return []
    pos, d, out = _pos(op, env), op.attrs["kv_head_dim"], []
    for cache, k0, k1 in caches(op):
        L = env.length(cache, 2)
        out += [Region.of(env.g, cache, (h * L + pos) * d + d0, (h * L + pos) * d + d1)
                for h, d0, d1 in _heads(op, c0, c1, k0, k1)]
    return out


def run(op: Op, env: Env, c0: int, c1: int, y) -> None:
    """Store the tile's product values ``y`` (columns ``[c0, c1)``, in the output's dtype) that
    belong to a cache into its row at the position."""
    if "kv_cols" not in op.attrs:
        return
    pos, d = _pos(op, env), op.attrs["kv_head_dim"]
    for cache, k0, k1 in caches(op):
        t = env.read(cache)
        for h, d0, d1 in _heads(op, c0, c1, k0, k1):
            a = k0 + h * d + d0 - c0
            t[0, h, pos, d0:d1] = y[a:a + d1 - d0].to(t.dtype)


def _col0(i: int):
    return lambda op, g: op.attrs["kv_cols"][i][0] if len(op.attrs.get("kv_cols", ())) > i else 0


#: template arguments (after the kind's own, C++ defaults: no epilogue): KV caches written,
#: the first column of each, D, the columns of one (Hkv * D), the caches' C type
TARGS = (Int("KV", lambda op, g: len(op.attrs.get("kv_cols", ())), default=0),
         Int("KC0", _col0(0), default=0), Int("KC1", _col0(1), default=0),
         Int("KVD", lambda op, g: op.attrs.get("kv_head_dim", 1), default=1),
         Int("KVN", lambda op, g: (lambda k: k[0][1] - k[0][0] if k else 0)(op.attrs.get("kv_cols")), default=0),
         Type("tc", "cache0", otherwise="float", default="float"))
#: function arguments: the position, the caches, their rows (a literal or the run-time length's slot)
ARGS = (Ptr("kv_pos", default="nullptr"), Ptr("cache0", default="nullptr"), Ptr("cache1", default="nullptr"),
        Expr("L", lambda op, g, bufs: bufs.length(op.outputs["cache0"], 2) if "cache0" in op.outputs else "0",
             default="0"))


def check_lengths(op: Op, bufs) -> None:
    """Raise NotImplementedError where the caches of one op have different run-time lengths."""
    if len({bufs.symbol(c, 2) for c, _, _ in caches(op)}) > 1:
        raise NotImplementedError(f"{op.name}: caches of different run-time lengths")
