"""Running an ATen op of the IR with PyTorch's own implementation, and the index checks that
make the simulator fault where eager PyTorch raises IndexError (with the kernel's fault codes).

The reference semantics (:mod:`fusec.ir.semantics`) and the generic instruction kind
(:mod:`fusec.instructions.generic`) both run ATen ops through here: it sits below both.
"""
from __future__ import annotations

from typing import Any

import torch

from fusec.abi import Fault, fault_remedy
from fusec.errors import IndexFaultError
from fusec.ir import Op, Ref
from fusec.ir.env import Env


def substitute(a: Any, op: Op, env: Env) -> Any:
    """``a`` (an op's ``args``/``kwargs``) with each :class:`Ref` replaced by the tensor it names."""
    if isinstance(a, Ref):
        return env.read(op.inputs[a.slot])
    if isinstance(a, (list, tuple)):
        return type(a)(substitute(x, op, env) for x in a)
    if isinstance(a, dict):
        return {k: substitute(v, op, env) for k, v in a.items()}
    return a


def index_fault(op: Op, what: str, value: int, bound: int, code: Fault, lo: int = 0) -> IndexFaultError:
    """The simulator's error for a run-time index outside ``[lo, bound)`` (what to do about it:
    :func:`fusec.abi.fault_remedy`), with the fields of the kernel's record (``code``: the fault code the
    kernel records for that index, :class:`fusec.abi.Fault`; :class:`fusec.errors.IndexFaultError`)."""
    src = f" at {op.source}" if op.source else ""
    return IndexFaultError(f"simulator: {what} {value} out of range [{lo}, {bound}) in {op.name} "
                           f"({op.kind}{src}); {fault_remedy(code, value, bound, what)}",
                           {"code": int(code), "value": value, "bound": bound})


#: gathers whose index range the simulator checks as eager does: base name -> (what, whether a
#: negative index counts from the end); the CUDA forms (fusec.cuda.gen.data) match
_GATHERS = {"embedding": (Fault.TOKEN_ID.doc, False), "index": ("index", True),
            "_unsafe_index": ("index", True), "index_select": ("index", False),
            "gather": ("index", False)}


def check_gather(op: Op, args: tuple, kwargs: dict) -> None:
    """Raise :func:`index_fault` when an index of a gather op is out of eager's range (where
    eager raises IndexError; PyTorch's own error would name no bound)."""
    target = op.attrs["target"]
    base = getattr(target, "_opname", None)
    if base not in _GATHERS or getattr(target, "namespace", None) != "aten":
        return
    what, wrap = _GATHERS[base]
    bound_args = dict(zip((a.name for a in target._schema.arguments), args))
    bound_args.update(kwargs)
    x = bound_args.get("weight", bound_args.get("self"))
    if not isinstance(x, torch.Tensor):
        return
    if base == "embedding":
        checks = [(bound_args.get("indices"), 0)]
    elif base in ("index", "_unsafe_index"):
        checks = [(t, d) for d, t in enumerate(bound_args.get("indices") or []) if t is not None]
    else:
        checks = [(bound_args.get("index"), bound_args.get("dim", 0) % max(x.dim(), 1))]
    for t, d in checks:
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.is_floating_point() or t.dtype == torch.bool:
            continue
        n = x.shape[d] if x.dim() else 1
        lo = -n if wrap else 0
        bad = (t < lo) | (t >= n)
        if bool(bad.any()):
            v = int(t[bad].reshape(-1)[0])
            raise index_fault(op, what, v, n, Fault.TOKEN_ID if base == "embedding" else Fault.INDEX, lo)


def run_aten(op: Op, env: Env) -> None:
    """Execute an ``aten.*`` / ``fusec.*`` op with PyTorch's own implementation."""
    target = op.attrs["target"]
    args = substitute(op.attrs["args"], op, env)
    kwargs = substitute(op.attrs["kwargs"], op, env)
    if env.device is not None and "device" in kwargs:
        kwargs["device"] = env.device   # evaluation on another device (position tables on the CPU)
    res = target(*args, **kwargs)
    if op.mutates:
        return  # copy_ already wrote its destination (a caller's tensor) in place
    if isinstance(res, torch.Tensor):
        res = [res]
    for (slot, t), r in zip(op.outputs.items(), res):
        env.set(t, r)
