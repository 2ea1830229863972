"""An artifact entry's objects as JSON-ready plain data, and back, so that loading an entry runs no code.

:func:`encode` turns an entry (dicts, lists, tuples, sets, numbers, strings, bytes, fusec's IR
objects, enums, tensors, torch dtypes/devices/layouts/memory formats/sizes, ATen operators) into
data made of ``dict``/``list``/``tuple``/``str``/``int``/``float``/``bool``/``None`` only (what
JSON holds: a tuple is written as an array), plus a dict of tensors (saved as safetensors by
:mod:`fusec.cache.artifacts`; ``bytes`` travel there too, as uint8 tensors). Objects that may be
shared or cyclic (IR objects, lists, dicts) go into a table and are referred to by index, so
sharing and cycles survive: ``[0, shape, [values]]`` an IR object (``shape`` indexes the
``shapes`` list of ``[module, class name, [field names]]``), ``[1, [values]]`` a list,
``[2, [key, value, ...]]`` a dict. Every other value is an array whose first element is a tag:
``["R", i]`` a table entry, ``["t", [...]]`` a tuple, ``["T", name]`` a tensor, ``["B", name]``
bytes (a uint8 tensor), ``["F", "inf"|"-inf"|"nan"]`` a float JSON cannot write,
``["E", [module, class], value]`` an enum member, ``["D", name]`` a dtype, ``["V", "cuda:0"]`` a
device, ``["L", name]`` a layout or memory format, ``["Z", [...]]`` a ``torch.Size``,
``["O", "aten.add.Tensor"]`` an operator, ``["s"|"fs", [...]]`` a set or frozenset,
``["sl", [...]]`` a slice, ``["c", [re, im]]`` a complex, ``["il"|"id", ...]`` torch.fx's
immutable list and dict.

:func:`decode` takes what ``json.loads`` gives back (arrays as lists) and rebuilds the objects:
an IR class is named by module and name and must be a class defined in one of
:data:`IR_MODULES` (created with ``object.__new__`` and its ``__dict__`` filled: no
``__init__``, no ``__setstate__``); an enum member is looked up by value; an operator is looked
up by name and never called; nothing else is named. Parsing JSON builds containers and values
only, so no code named by an entry can run (issue 30, item 13).
"""
from __future__ import annotations

import enum
import importlib
import math
import re
from typing import Any

import torch
from torch.fx.immutable_collections import immutable_dict, immutable_list

#: the modules whose classes an entry may hold: the IR (graph, schedule), the instruction kinds
#: (tiles, regions) and the kernel's buffer plan
IR_MODULES = ("fusec.ir.", "fusec.instructions.", "fusec.cuda.codegen.")
#: an identifier that is not a special (dunder) name: operator name parts, class names
_IDENT = re.compile(r"(?!__)[A-Za-z_][A-Za-z0-9_]*")
_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


class EntryFormatError(ValueError):
    """An entry that does not decode: an unknown tag, a class outside :data:`IR_MODULES`, an
    operator name that is not an operator's, a dangling reference."""


def _ir_class(x: Any) -> bool:
    t = type(x)
    return (t.__module__ + ".").startswith(IR_MODULES) and hasattr(x, "__dict__") and not isinstance(x, type)


def encode(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(data, tensors)``: ``obj`` as plain data and the CPU tensors it refers to by name.

    Raises:
        TypeError: a value of a type an entry cannot hold (named)."""
    table: list[Any] = []
    shapes: list[tuple[str, str, tuple[str, ...]]] = []   # (module, qualname, field names)
    shape_index: dict[tuple, int] = {}
    memo: dict[int, int] = {}
    keep: list[Any] = []               # the originals, so that no id is reused meanwhile
    tensors: dict[str, torch.Tensor] = {}
    tensor_names: dict[int, str] = {}
    plain = (bool, int, str)
    plain_types = {bool, int, str, type(None)}   # most values: no call needed

    def encs(xs: Any) -> list[Any]:
        return [v if type(v) in plain_types else enc(v) for v in xs]

    def ref(x: Any) -> tuple[str, int] | None:
        i = memo.get(id(x))
        return None if i is None else ("R", i)

    def new(x: Any) -> int:
        i = memo[id(x)] = len(table)
        keep.append(x)
        table.append(None)
        return i

    def enc(x: Any) -> Any:
        if x is None or type(x) in plain:
            return x
        t = type(x)
        if t is float:
            return x if math.isfinite(x) else ("F", repr(x))
        if t is bytes:
            name = f"t{len(tensors)}"
            tensors[name] = torch.frombuffer(bytearray(x), dtype=torch.uint8) if x else torch.empty(0, dtype=torch.uint8)
            return ("B", name)
        if t is list:
            r = ref(x)
            if r is None:
                i = new(x)
                table[i] = (1, encs(x))
                r = ("R", i)
            return r
        if t is dict:
            r = ref(x)
            if r is None:
                i = new(x)
                flat: list[Any] = []
                for k, v in x.items():
                    flat.append(enc(k))
                    flat.append(enc(v))
                table[i] = (2, flat)
                r = ("R", i)
            return r
        if t is tuple:
            return ("t", encs(x))
        if isinstance(x, enum.Enum):
            return ("E", (t.__module__, t.__qualname__), enc(x.value))
        if isinstance(x, torch.Tensor):
            name = tensor_names.get(id(x))
            if name is None:
                from torch._subclasses.fake_tensor import unset_fake_temporarily
                with unset_fake_temporarily():   # a graph's constant, while AOT's fake mode is on
                    c = x.detach().to("cpu").contiguous().clone()   # safetensors stores no shared memory
                name = tensor_names[id(x)] = f"t{len(tensors)}"
                tensors[name] = c
                keep.append(x)
            return ("T", name)
        if isinstance(x, torch.dtype):
            return ("D", str(x).removeprefix("torch."))
        if isinstance(x, torch.device):
            return ("V", str(x))
        if isinstance(x, (torch.layout, torch.memory_format)):
            return ("L", str(x).removeprefix("torch."))
        if isinstance(x, torch.Size):
            return ("Z", [int(d) for d in x])
        if isinstance(x, _OPS):
            return ("O", str(x))
        if t in (set, frozenset):   # hashable members: no cycle through a set
            return ("s" if t is set else "fs", [enc(v) for v in x])
        if t is slice:
            return ("sl", [enc(x.start), enc(x.stop), enc(x.step)])
        if t is complex:
            return ("c", [enc(x.real), enc(x.imag)])
        if t is immutable_list:
            return ("il", [enc(v) for v in x])
        if t is immutable_dict:
            return ("id", [[enc(k), enc(v)] for k, v in x.items()])
        if _ir_class(x):
            r = ref(x)
            if r is None:
                i = new(x)
                fields = vars(x)
                key = (t, tuple(fields))
                si = shape_index.get(key)
                if si is None:
                    si = shape_index[key] = len(shapes)
                    shapes.append((t.__module__, t.__qualname__, tuple(fields)))
                table[i] = (0, si, encs(fields.values()))
                r = ("R", i)
            return r
        raise TypeError(f"an artifact entry cannot hold a {t.__module__}.{t.__qualname__}")

    root = enc(obj)
    return {"root": root, "table": table, "shapes": shapes}, tensors


def _class(module: Any, name: Any) -> type:
    """The IR class ``module.name``, or EntryFormatError: only a class defined at the top level
    of a module of :data:`IR_MODULES` (one attribute lookup, no dotted walk)."""
    if not (type(module) is str and type(name) is str and (module + ".").startswith(IR_MODULES)
            and all(_IDENT.fullmatch(p) for p in module.split(".")) and _IDENT.fullmatch(name)):
        raise EntryFormatError(f"entry names {module!r}.{name!r}, which is not an IR class")
    obj = vars(importlib.import_module(module)).get(name)
    if not isinstance(obj, type) or obj.__module__ != module:
        raise EntryFormatError(f"entry names {module}.{name}, which is not an IR class")
    return obj


#: the operator namespaces an entry may name (looking up another would create it in torch.ops)
_NAMESPACES = ("aten", "prims", "fusec")


def operator(name: Any) -> Any:
    """``torch.ops.<ns>.<op>.<overload>`` from its name (``aten.add.Tensor``); looked up, never
    called. Only operators fusec places (:func:`fusec.instructions.generic.aten_category`).
    Raises EntryFormatError for any other name."""
    parts = name.split(".") if type(name) is str else []
    if len(parts) not in (2, 3) or parts[0] not in _NAMESPACES or not all(_IDENT.fullmatch(p) for p in parts):
        raise EntryFormatError(f"entry names {name!r}, which is not an operator name")
    if parts[0] == "fusec":
        import fusec.frontend.custom_ops  # noqa: F401 - registers torch.ops.fusec
    from fusec.instructions.generic import aten_category
    try:
        obj: Any = torch.ops
        for part in parts:
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError):
        raise EntryFormatError(f"entry names {name!r}, which is not an operator") from None
    one = obj if isinstance(obj, torch._ops.OpOverload) else getattr(obj, "default", None)
    if not isinstance(obj, _OPS) or not isinstance(one, torch._ops.OpOverload) or aten_category(one) is None:
        raise EntryFormatError(f"entry names {name!r}, which is not an operator fusec places")
    return obj


#: torch's dtypes, layouts and memory formats by name, read from torch's namespace without
#: touching a lazily imported attribute
_TORCH_VALUES = {k: v for k, v in vars(torch).items()
                 if isinstance(v, (torch.dtype, torch.layout, torch.memory_format))}


def _torch_value(name: Any, kinds: tuple[type, ...]) -> Any:
    v = _TORCH_VALUES.get(name) if type(name) is str else None
    if not isinstance(v, kinds):
        raise EntryFormatError(f"entry names torch.{name!r}, which is not a {kinds[0].__name__}")
    return v


def decode(data: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode`, from what ``json.loads`` returns for its output (tuples come
    back as lists). Raises EntryFormatError for anything it did not write. JSON shares no value,
    so the objects built are bounded by the text's size: a table entry and a blob of bytes
    referred to many times are built once."""
    try:
        return _decode(data, tensors)
    except EntryFormatError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise EntryFormatError(f"malformed entry ({type(e).__name__}: {e})") from None


_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _decode(data: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if type(data) is not dict or type(data.get("table")) is not list or type(data.get("shapes")) is not list:
        raise EntryFormatError("not an encoded entry")
    table, shapes = data["table"], data["shapes"]
    classes: list[tuple[type, tuple[str, ...]]] = []
    for sh in shapes:
        module, qualname, fields = sh
        cls = _class(module, qualname)
        if (issubclass(cls, enum.Enum) or type(fields) is not list
                or not all(type(f) is str and _IDENT.fullmatch(f) for f in fields)):
            raise EntryFormatError(f"bad class entry {module}.{qualname}")
        classes.append((cls, tuple(fields)))
    objs: list[Any] = []
    new = object.__new__
    for e in table:   # first every shared object, empty: references may point forward or in a cycle
        kind = e[0]
        if kind == 0:
            objs.append(new(classes[e[1]][0]))   # no __init__, no __setstate__: its fields below
        elif kind == 1:
            objs.append([])
        elif kind == 2:
            objs.append({})
        else:
            raise EntryFormatError("bad table entry kind")
    plain = (bool, int, float, str)
    n = len(objs)
    blobs: dict[str, bytes] = {}

    def dec(x: Any) -> Any:
        if x is None or type(x) in plain:
            return x
        if type(x) is not list or len(x) < 2:
            raise EntryFormatError(f"bad value of type {type(x).__name__}")
        tag, v = x[0], x[1]
        if tag == "R":
            if type(v) is not int or not 0 <= v < n:
                raise EntryFormatError("dangling reference")
            return objs[v]
        if tag == "t":
            return tuple([dec(m) for m in v])
        if tag == "T" or tag == "B":
            if type(v) is not str or v not in tensors:
                raise EntryFormatError(f"no tensor {v!r} in the entry")
            if tag == "T":
                return tensors[v]
            got = blobs.get(v)   # once per name: an entry naming one blob many times copies it once
            if got is None:
                b = tensors[v]
                if b.dtype != torch.uint8 or b.dim() != 1:
                    raise EntryFormatError(f"bytes {v!r} are not a uint8 vector")
                got = blobs[v] = b.numpy().tobytes()
            return got
        if tag == "F":
            if v not in _NONFINITE:
                raise EntryFormatError(f"bad float {v!r}")
            return _NONFINITE[v]
        if tag == "E":
            cls = _class(*v)
            if not issubclass(cls, enum.Enum):
                raise EntryFormatError(f"entry names {v!r} as an enum")
            return cls(dec(x[2]))   # a member looked up by value
        if tag == "D":
            return _torch_value(v, (torch.dtype,))
        if tag == "V":
            if type(v) is not str or len(v) > 32:
                raise EntryFormatError("bad device")
            return torch.device(v)
        if tag == "L":
            return _torch_value(v, (torch.layout, torch.memory_format))
        if tag == "Z":
            if type(v) is not list or not all(type(d) is int for d in v):
                raise EntryFormatError("bad size")
            return torch.Size(v)
        if tag == "O":
            return operator(v)
        if tag in ("s", "fs"):
            return (set if tag == "s" else frozenset)(dec(m) for m in v)
        if tag == "sl":
            return slice(*(dec(m) for m in v))
        if tag == "c":
            parts = [dec(m) for m in v]
            if len(parts) != 2 or not all(type(d) is float for d in parts):
                raise EntryFormatError("bad complex")
            return complex(parts[0], parts[1])
        if tag == "il":
            return immutable_list(dec(m) for m in v)
        if tag == "id":
            return immutable_dict((dec(k), dec(m)) for k, m in v)
        raise EntryFormatError(f"unknown tag {tag!r}")

    plain_types = {bool, int, float, str, type(None)}   # most values: no call needed

    # then their contents: IR objects first, so that a frozen IR object used as a dict key or set
    # member in a container hashes its fields, not an empty object (the IR's own fields hold no
    # set or dict keyed by IR objects)
    for o, e in zip(objs, table):
        if e[0] == 0:
            fields = classes[e[1]][1]
            values = e[2]
            if type(values) is not list or len(values) != len(fields):
                raise EntryFormatError("field count differs from the class entry")
            o.__dict__.update(zip(fields, [v if type(v) in plain_types else dec(v) for v in values]))
    for o, e in zip(objs, table):
        if e[0] == 1:
            o.extend([v if type(v) in plain_types else dec(v) for v in e[1]])
        elif e[0] == 2:
            if len(e[1]) % 2:
                raise EntryFormatError("a dict entry with a key and no value")
            flat = [v if type(v) in plain_types else dec(v) for v in e[1]]
            o.update(zip(flat[0::2], flat[1::2]))
    return dec(data["root"])
