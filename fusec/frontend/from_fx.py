"""Build the IR (:mod:`fusec.ir`) from a core-ATen FX graph produced by AOT autograd."""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fusec.frontend.capture import MODEL_TENSORS, node_source
from fusec.errors import UnsupportedOpError
from fusec.instructions.generic import aten_category
from fusec.ir import Graph, Op, Ref, Role, TensorInfo


def _meta(node: torch.fx.Node) -> Any:
    return node.meta.get("val", node.meta.get("example_value"))


def graph_from_aten(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Graph:
    """Translate an ATen FX graph into a :class:`Graph`.

    Roles: inputs written by ``copy_`` are KV_CACHE (4-D float) or STATE (others); float
    inputs that are read only are WEIGHT when they are the model's parameters or buffers (the
    capture records which, ``gm.meta[MODEL_TENSORS]``; without that record every float
    read-only input counts as one); other inputs are INPUT (token ids, positions, a float
    ``attention_mask``, ``inputs_embeds``: read at run time, never folded); ``get_attr``
    tensors are CONSTANT. Every ``call_function`` becomes an ``aten.*`` op with an argument template.

    Raises:
        UnsupportedOpError: an op that no instruction kind can place (names op and source line).
    """
    g = Graph()
    nodes = list(gm.graph.nodes)
    mutated = set()
    for n in nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default:
            if isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder":
                mutated.add(n.args[0].name)
    owned = gm.meta.get(MODEL_TENSORS)
    env: dict[str, str] = {}  # fx node name -> tensor name (or tuple element names)
    idx = 0
    for n in nodes:
        if n.op == "placeholder":
            v = _meta(n)
            if not isinstance(v, torch.Tensor):
                raise UnsupportedOpError(f"graph input {n.name} is not a tensor ({type(v).__name__})")
            if n.name in mutated:
                role = Role.KV_CACHE if (v.dim() == 4 and v.is_floating_point()) else Role.STATE
            elif v.is_floating_point() and (owned is None or idx >= len(owned) or owned[idx]):
                role = Role.WEIGHT
            else:
                role = Role.INPUT
            g.add_tensor(TensorInfo(n.name, tuple(v.shape), v.dtype, role, input_index=idx))
            g.inputs.append(n.name)
            env[n.name] = n.name
            idx += 1
        elif n.op == "get_attr":
            val = getattr(gm, n.target)
            # a tensor constant of the ATen graph (HF's sliding-window roll index, one in Falcon's
            # step): a real tensor, copied outside the fake mode AOT autograd may have active
            with unset_fake_temporarily():
                value = val.detach().clone()
            g.add_tensor(TensorInfo(n.name, tuple(val.shape), val.dtype, Role.CONSTANT, value=value))
            env[n.name] = n.name
        elif n.op == "call_function":
            if n.target is operator.getitem:
                env[n.name] = env[n.args[0].name][n.args[1]]
                continue
            _add_call(g, n, env)
        elif n.op == "output":
            outs = n.args[0]
            for o in (outs if isinstance(outs, (list, tuple)) else [outs]):
                if o is None or not isinstance(o, torch.fx.Node):
                    raise UnsupportedOpError("graph output is not a tensor")
                g.outputs.append(env[o.name])
    for t in g.outputs:
        if g.tensors[t].role == Role.INTERMEDIATE:
            g.tensors[t].role = Role.OUTPUT
    return g


#: (a piece of the model line, what to tell the user) for unsupported ops whose cause is known
_HINTS = (
    ("self.keys.roll(", " (HF's sliding-window cache is full and rolls its window each step: this "
                        "step runs in the fallback; a StaticCache no longer than the model's "
                        "sliding_window keeps every step in fusec)"),
)


def _add_call(g: Graph, n: torch.fx.Node, env: dict[str, Any]) -> None:
    target = n.target
    kind = str(target)
    source = node_source(n)
    if aten_category(target) is None:
        hint = next((h for where, h in _HINTS if where in (source or "")), "")
        raise UnsupportedOpError(f"unsupported op {kind} (node {n.name}) at {source or 'unknown source'}{hint}")
    inputs: dict[str, str] = {}

    def conv(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            slot = f"in{len(inputs)}"
            inputs[slot] = env[a.name]
            return Ref(slot)
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        return a

    args = conv(tuple(n.args))
    kwargs = {k: conv(v) for k, v in n.kwargs.items()}
    val = _meta(n)
    outputs: dict[str, str] = {}
    mutates: tuple[str, ...] = ()
    if target is torch.ops.aten.copy_.default:
        dst = env[n.args[0].name]
        outputs["mut0"] = dst
        mutates = ("mut0",)
        env[n.name] = dst
    elif isinstance(val, torch.Tensor):
        g.add_tensor(TensorInfo(n.name, tuple(val.shape), val.dtype))
        outputs["out"] = n.name
        env[n.name] = n.name
    elif isinstance(val, (list, tuple)):
        names = []
        for i, v in enumerate(val):
            nm = f"{n.name}_{i}"
            g.add_tensor(TensorInfo(nm, tuple(v.shape), v.dtype))
            outputs[f"out{i}"] = nm
            names.append(nm)
        env[n.name] = names
    else:
        raise UnsupportedOpError(f"op {kind} at {source} returns {type(val).__name__}, not tensors")
    g.ops.append(Op(n.name, kind, inputs, outputs,
                    attrs={"target": target, "args": args, "kwargs": kwargs},
                    mutates=mutates, source=source))
