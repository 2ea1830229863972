"""An artifact entry's objects as plain data, and back, so that loading an entry runs no code.

:func:`encode` turns an entry (dicts, lists, tuples, sets, numbers, strings, bytes, fusec's IR
objects, enums, tensors, torch dtypes/devices/layouts/memory formats/sizes, ATen operators) into
data made of ``dict``/``list``/``str``/``int``/``float``/``bytes``/``bool``/``None`` only, plus
a dict of tensors (saved as safetensors by :mod:`fusec.runtime.artifacts`). Objects that may be
shared or cyclic (IR objects, lists, dicts) go into a table and are referred to by index,
so sharing and cycles survive. Tagged dicts say what a value was: ``{"R": i}`` a table entry,
``{"T": name}`` a tensor, ``{"t": [...]}`` a tuple, ``{"s"/"fs": [...]}`` a set or frozenset, ``{"E": class, "v": value}`` an enum member,
``{"D": name}`` a dtype, ``{"V": "cuda:0"}`` a device, ``{"L": name}`` a layout or memory format,
``{"Z": [...]}`` a ``torch.Size``, ``{"O": "aten.add.Tensor"}`` an operator, ``{"sl": [...]}`` a
slice, ``{"c": [re, im]}`` a complex, ``{"il": [...]}``/``{"id": [...]}`` torch.fx's immutable
list and dict.

:func:`decode` rebuilds the objects: an IR class is named by module and name and must be a
class defined in one of :data:`IR_MODULES` (created with ``object.__new__`` and its ``__dict__``
filled: no ``__init__``, no ``__setstate__``); an operator is looked up by name and never called;
nothing else is named. The data itself travels as a pickle that names no global at all
(:func:`fusec.runtime.artifacts.loads` refuses every ``find_class``): with no callable reachable,
unpickling it can only build containers and values (Python's pickle docs, "Restricting Globals").
"""
from __future__ import annotations

import enum
import importlib
import re
from typing import Any

import torch
from torch.fx.immutable_collections import immutable_dict, immutable_list

#: the modules whose classes an entry may hold: the IR (graph, schedule), the instruction kinds
#: (tiles, regions) and the kernel's buffer plan
IR_MODULES = ("fusec.ir.", "fusec.instructions.", "fusec.cuda.codegen")
#: an identifier that is not a special (dunder) name: operator name parts, class names
_IDENT = re.compile(r"(?!__)[A-Za-z_][A-Za-z0-9_]*")
_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


class EntryFormatError(ValueError):
    """An entry that does not decode: an unknown tag, a class outside :data:`IR_MODULES`, an
    operator name that is not an operator's, a dangling reference."""


def _ir_class(x: Any) -> bool:
    t = type(x)
    return t.__module__.startswith(IR_MODULES) and hasattr(x, "__dict__") and not isinstance(x, type)


def encode(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(data, tensors)``: ``obj`` as plain data and the CPU tensors it refers to by name.

    Raises:
        TypeError: a value of a type an entry cannot hold (named)."""
    table: list[Any] = []
    memo: dict[int, int] = {}
    keep: list[Any] = []               # the originals, so that no id is reused meanwhile
    tensors: dict[str, torch.Tensor] = {}
    tensor_names: dict[int, str] = {}

    def ref(x: Any, make) -> dict[str, int]:
        i = memo.get(id(x))
        if i is None:
            i = memo[id(x)] = len(table)
            keep.append(x)
            table.append(None)
            table[i] = make()
        return {"R": i}

    def enc(x: Any) -> Any:
        if x is None or type(x) in (bool, int, float, str, bytes):
            return x
        if isinstance(x, enum.Enum):
            return {"E": [type(x).__module__, type(x).__qualname__], "v": enc(x.value)}
        if isinstance(x, torch.Tensor):
            name = tensor_names.get(id(x))
            if name is None:
                from torch._subclasses.fake_tensor import unset_fake_temporarily
                with unset_fake_temporarily():   # a graph's constant, while AOT's fake mode is on
                    t = x.detach().to("cpu").contiguous().clone()   # safetensors stores no shared memory
                name = tensor_names[id(x)] = f"t{len(tensors)}"
                tensors[name] = t
                keep.append(x)
            return {"T": name}
        if isinstance(x, torch.dtype):
            return {"D": str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {"V": str(x)}
        if isinstance(x, (torch.layout, torch.memory_format)):
            return {"L": str(x).removeprefix("torch.")}
        if isinstance(x, torch.Size):
            return {"Z": [int(d) for d in x]}
        if isinstance(x, _OPS):
            return {"O": str(x)}
        if type(x) is tuple:
            return {"t": [enc(v) for v in x]}
        if type(x) is slice:
            return {"sl": [enc(x.start), enc(x.stop), enc(x.step)]}
        if type(x) is complex:
            return {"c": [x.real, x.imag]}
        if type(x) is immutable_list:
            return {"il": [enc(v) for v in x]}
        if type(x) is immutable_dict:
            return {"id": [[enc(k), enc(v)] for k, v in x.items()]}
        if type(x) is list:
            return ref(x, lambda: {"list": [enc(v) for v in x]})
        if type(x) is dict:
            return ref(x, lambda: {"dict": [[enc(k), enc(v)] for k, v in x.items()]})
        if type(x) in (set, frozenset):   # hashable members: no cycle through a set
            return {"s" if type(x) is set else "fs": [enc(v) for v in x]}
        if _ir_class(x):
            cls = type(x)
            return ref(x, lambda: {"cls": [cls.__module__, cls.__qualname__],
                                   "state": [[k, enc(v)] for k, v in vars(x).items()]})
        raise TypeError(f"an artifact entry cannot hold a {type(x).__module__}.{type(x).__qualname__}")

    root = enc(obj)
    return {"root": root, "table": table}, tensors


def _class(module: Any, qualname: Any) -> type:
    """The IR class ``module.qualname``, or EntryFormatError: only classes defined in
    :data:`IR_MODULES`, found by plain attribute lookup."""
    if not (isinstance(module, str) and isinstance(qualname, str) and module.startswith(IR_MODULES)
            and all(_IDENT.fullmatch(p) for p in module.split(".") + qualname.split("."))):
        raise EntryFormatError(f"entry names {module!r}.{qualname!r}, which is not an IR class")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, type) or obj.__module__ != module:
        raise EntryFormatError(f"entry names {module}.{qualname}, which is not an IR class")
    return obj


def operator(name: Any) -> Any:
    """``torch.ops.<ns>.<op>[.<overload>]`` from its name (``aten.add.Tensor``); looked up,
    never called. Raises EntryFormatError for a name that is not an operator's."""
    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) < 2 or not all(_IDENT.fullmatch(p) for p in parts):
        raise EntryFormatError(f"entry names {name!r}, which is not an operator name")
    if parts[0] == "fusec":
        import fusec.frontend.custom_ops  # noqa: F401 - registers torch.ops.fusec
    obj: Any = torch.ops
    for part in parts:
        obj = getattr(obj, part)
    if not isinstance(obj, _OPS):
        raise EntryFormatError(f"entry names {name!r}, which is not an operator")
    return obj


_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


def _torch_value(name: Any, kinds: tuple[type, ...]) -> Any:
    v = getattr(torch, name, None) if isinstance(name, str) and _IDENT.fullmatch(name) else None
    if not isinstance(v, kinds):
        raise EntryFormatError(f"entry names torch.{name!r}, which is not a {kinds[0].__name__}")
    return v


def decode(data: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode`. Raises EntryFormatError for anything it did not write."""
    if not isinstance(data, dict) or not isinstance(data.get("table"), list) or "root" not in data:
        raise EntryFormatError("not an encoded entry")
    table = data["table"]
    objs: list[Any] = []
    for e in table:   # first every shared object, empty: references may point forward or in a cycle
        if not isinstance(e, dict) or len(e) not in (1, 2):
            raise EntryFormatError("bad table entry")
        if "cls" in e:
            cls = _class(*e["cls"]) if isinstance(e["cls"], list) and len(e["cls"]) == 2 else None
            if cls is None or issubclass(cls, enum.Enum) or not isinstance(e.get("state"), list):
                raise EntryFormatError("bad class entry")
            objs.append(object.__new__(cls))   # no __init__, no __setstate__: its fields below
        elif "list" in e:
            objs.append([])
        elif "dict" in e:
            objs.append({})
        else:
            raise EntryFormatError(f"bad table entry {sorted(e)}")

    def dec(x: Any) -> Any:
        if x is None or type(x) in (bool, int, float, str, bytes):
            return x
        if type(x) is list:
            raise EntryFormatError("a bare list outside the table")
        if type(x) is not dict or len(x) not in (1, 2):
            raise EntryFormatError(f"bad value of type {type(x).__name__}")
        (tag, v), = list(x.items())[:1]
        if tag == "R":
            if type(v) is not int or not 0 <= v < len(objs):
                raise EntryFormatError("dangling reference")
            return objs[v]
        if tag == "T":
            if v not in tensors:
                raise EntryFormatError(f"no tensor {v!r} in the entry")
            return tensors[v]
        if tag == "E":
            cls = _class(*v) if isinstance(v, list) and len(v) == 2 else None
            if cls is None or not issubclass(cls, enum.Enum):
                raise EntryFormatError(f"entry names {v!r} as an enum")
            return cls(dec(x["v"]))   # a member lookup by value
        if tag == "D":
            return _torch_value(v, (torch.dtype,))
        if tag == "V":
            return torch.device(str(v))
        if tag == "L":
            return _torch_value(v, (torch.layout, torch.memory_format))
        if tag == "Z":
            return torch.Size([int(d) for d in v])
        if tag == "O":
            return operator(v)
        if tag == "t":
            return tuple(dec(m) for m in v)
        if tag in ("s", "fs"):
            return (set if tag == "s" else frozenset)(dec(m) for m in v)
        if tag == "sl":
            return slice(*(dec(m) for m in v))
        if tag == "c":
            return complex(float(v[0]), float(v[1]))
        if tag == "il":
            return immutable_list(dec(m) for m in v)
        if tag == "id":
            return immutable_dict((dec(k), dec(m)) for k, m in v)
        raise EntryFormatError(f"unknown tag {tag!r}")

    for i, e in enumerate(table):   # then their contents
        o = objs[i]
        if "cls" in e:
            o.__dict__.update({str(k): dec(v) for k, v in e["state"]})
        elif "list" in e:
            o.extend(dec(v) for v in e["list"])
        elif "dict" in e:
            o.update((dec(k), dec(v)) for k, v in e["dict"])
    return dec(data["root"])
