"""A digest of the Python a model's forward runs, for keys that must change when that code does.

A precompiled step (:mod:`fusec.frontend.precompiled`) loads dynamo's graph without tracing, and
torch cannot save dynamo's guards on an object's identity or on globals: a process that patched
the model's code (a class's ``forward`` replaced, as kernel libraries do; a module function such
as ``apply_rotary_pos_emb`` rebound), registered another attention function, or hooked a module
would run the graph traced before the change. :func:`model_code_digest` covers those: every
function and every method of the classes defined in the modules the model's code comes from
(the modules of its module classes and the modules their names were imported from), the
attention and mask registries of transformers, and the hooks on the model's modules and the
global ``nn.Module`` hooks. A function's digest is its bytecode, names and constants (nested
code objects recursively), its defaults and closure values that are numbers or strings, and the
digests of the functions in its closure (a decorator's wrapped function); never an address, so
the same code gives the same digest in every process. Not covered: other objects' state (a
hook's object, a global flag read by the model's code) and code in modules the model's modules
do not import names from.

Cost: about 0.1 s for a Llama on a 2-core CPU (a few thousand functions).
"""
from __future__ import annotations

import hashlib
import logging
import sys
import types
from typing import Any

import torch

log = logging.getLogger("fusec")

#: closure depth followed from a function (decorators wrap one or two levels)
_DEPTH = 4


def _code_bytes(code: types.CodeType) -> bytes:
    parts = [code.co_code, repr(code.co_names).encode(), repr(code.co_varnames).encode(),
             getattr(code, "co_qualname", code.co_name).encode()]
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            parts.append(_code_bytes(c))
        elif isinstance(c, frozenset):   # its repr's order follows the string hash seed
            parts.append(repr(sorted(map(repr, c))).encode())
        else:
            parts.append(repr(c).encode())
    return b"\0".join(parts)


def function_digest(f: Any, depth: int = 0) -> bytes:
    """The bytes that identify a function's code (see the module docstring); the type's name
    for a callable without Python code."""
    f = getattr(f, "__func__", f)
    code = getattr(f, "__code__", None)
    if not isinstance(code, types.CodeType):
        return f"<{type(f).__module__}.{type(f).__qualname__}>".encode()
    parts = [_code_bytes(code), _plain(getattr(f, "__defaults__", None))]
    for cell in getattr(f, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:   # an empty cell
            continue
        if isinstance(v, (types.FunctionType, types.MethodType)):
            parts.append(function_digest(v, depth + 1) if depth < _DEPTH else b"...")
        else:
            parts.append(_plain(v))
    return b"\1".join(parts)


def _plain(v: Any) -> bytes:
    """A closure cell's or default's value: numbers, strings and tuples of them by value, any
    other object by its type (an object's contents are not followed)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v).encode()
    if isinstance(v, tuple) and all(x is None or isinstance(x, (bool, int, float, str)) for x in v):
        return repr(v).encode()
    return f"<{type(v).__module__}.{type(v).__qualname__}>".encode()


def _callables_of_class(cls: type) -> list[tuple[str, Any]]:
    out = []
    for name, v in sorted(vars(cls).items()):
        if isinstance(v, (staticmethod, classmethod)):
            v = v.__func__
        elif isinstance(v, property):
            v = v.fget
        if isinstance(v, types.FunctionType):
            out.append((name, v))
    return out


def _model_modules(model: torch.nn.Module) -> list[str]:
    """The Python modules the model's code comes from: those defining its module classes, and
    those the functions and classes named in them were imported from; torch's excepted."""
    names = {type(m).__module__ for m in model.modules()}
    for name in list(names):
        mod = sys.modules.get(name)
        for k, v in vars(mod).items() if mod is not None else ():
            if _injected(k):   # dynamo's compiled functions carry their backend's module
                continue
            home = getattr(v, "__module__", None) if isinstance(v, (types.FunctionType, type)) else None
            if isinstance(home, str) and home in sys.modules:
                names.add(home)
    # not torch's own modules: dynamo wraps nn.Module.__init__ once it has run (generation
    # tagging), and torch's version is in every key anyway
    return sorted(n for n in names if n != "builtins" and n.split(".")[0] != "torch")


def _registries() -> list[tuple[str, Any]]:
    """transformers' attention and mask function registries (``AttentionInterface.register``)."""
    out = []
    for modname, attr in (("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS"),
                          ("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS")):
        reg = getattr(sys.modules.get(modname), attr, None)
        try:
            out += [(f"{attr}[{k}]", reg[k]) for k in sorted(reg.keys())]
        except Exception:   # noqa: BLE001 - another transformers: its modules' digests remain
            continue
    return out


def _hooks(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """Every forward / pre-forward hook of the model's modules and the global ones."""
    from torch.nn.modules import module as nn_module
    out = []
    for g in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called"):
        d = getattr(nn_module, g, None)
        out += [(f"{g}[{i}]", h) for i, h in enumerate(d.values())] if isinstance(d, dict) else []
    for path, m in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks"):
            out += [(f"{path}.{attr}[{i}]", h) for i, h in enumerate(getattr(m, attr, {}).values())]
    return out


#: the prefixes of the globals dynamo puts into the modules whose frames it traced
#: (torch/_dynamo: ``__compiled_fn_47_<uuid>``, ``__resume_at_...``, ``__transformed_code_...``, the
#: polyfills and helpers it installs); some stay after ``torch._dynamo.reset()``
_DYNAMO_PREFIXES = ("__compiled_fn", "__resume_at", "__transformed_code", "__import_", "___",
                    "__comprehension_", "__subclass_", "__gen_rand_values", "__warnings_warn_wrapper")


def _injected(name: str) -> bool:
    """A module global that no source of the model defines: one dynamo put there
    (:data:`_DYNAMO_PREFIXES`), or a dunder (``__getattr__``, ``__builtins__``: import
    machinery). Counting dynamo's made the digest of one model change within a process between
    two calls (a precompiled step traced anew). A module's own ``def __helper`` (no trailing
    ``__``) counts as any function."""
    return name.startswith(_DYNAMO_PREFIXES) or (name.startswith("__") and name.endswith("__"))


def _code_functions(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(label, function)`` for every function the digest covers (the module docstring)."""
    out = []
    for name in _model_modules(model):
        mod = sys.modules[name]
        for k, v in sorted(vars(mod).items()):
            if _injected(k):
                continue
            if isinstance(v, types.FunctionType):
                out.append((f"{name}.{k}", v))
            elif isinstance(v, type) and v.__module__ == name:
                out += [(f"{name}.{k}.{a}", f) for a, f in _callables_of_class(v)]
    return out + _registries() + _hooks(model)


def model_code_digest(model: torch.nn.Module) -> str:
    """Hex sha256 of the code ``model``'s forward may run (see the module docstring)."""
    h = hashlib.sha256()
    for label, f in _code_functions(model):
        h.update(f"{label}\0".encode() + function_digest(f))
    return h.hexdigest()


def model_code_objects(model: torch.nn.Module) -> list[Any]:
    """The objects :func:`model_code_digest` reads (the functions, their code objects, the
    classes, the hooks and registered attention functions), for a process to see by identity
    (``is``; ~1 ms for a Llama on a 2-core CPU, no bytecode read) that one was replaced since a
    step was traced, then confirm with the digest. The caller keeps the list: its references keep
    the objects alive, so a new object never takes a freed one's address."""
    objs: list[Any] = []
    for name in _model_modules(model):
        for k, v in vars(sys.modules[name]).items():
            if _injected(k):
                continue
            if isinstance(v, types.FunctionType):
                objs += (v, v.__code__)
            elif isinstance(v, type) and v.__module__ == name:
                objs.append(v)
                for f in vars(v).values():
                    f = getattr(f, "__func__", f)
                    objs += (f, getattr(f, "__code__", None))
    objs += [f for _, f in _registries() + _hooks(model)]
    return objs


class CodeWatch:
    """Whether ``model``'s code (:func:`model_code_digest`'s scope: its modules' functions and
    classes, its hooks, transformers' attention registry) changed since the last :meth:`changed`
    in this process. Dynamo's guards miss such changes where a step keeps none: a loaded
    precompiled step has no guard on globals, and dynamo skips guards on module hooks
    (``skip_nnmodule_hook_guards``), so a hook added after a trace is not seen by a plain
    ``torch.compile`` either. The compiled steps kept for a model are dropped when it says so."""

    def __init__(self, model: torch.nn.Module):
        # the backend's import patches transformers (its RoPE and SDPA polyfills): before the first
        # look, or the first trace would look like a change of the model's code
        import fusec.frontend.backend  # noqa: F401
        self.model = model
        self._objs: list[Any] | None = None
        self._digest: str | None = None

    def changed(self) -> bool:
        """True when an object moved since the last call and the digest differs (False at the
        first call); cheap when nothing moved."""
        objs = model_code_objects(self.model)
        if self._objs is not None and len(objs) == len(self._objs) and all(a is b for a, b in zip(objs, self._objs)):
            return False
        digest = model_code_digest(self.model)
        moved = self._digest is not None and digest != self._digest
        self._objs, self._digest = objs, digest
        return moved

    def clear_if_changed(self, steps: dict, what: str) -> None:
        """Empty ``steps`` (the compiled steps kept for the model) when :meth:`changed`, with
        one line naming ``what`` was traced: the next call traces again."""
        if self.changed() and steps:
            log.info("fusec: the model's code changed since its %s traced (a function of its modules, a "
                     "method, a hook or an attention function replaced): tracing again", what)
            steps.clear()
