"""An artifact entry's format (fusec/cache/artifacts.py ``dumps``/``loads``,
fusec/cache/entry_codec.py): a safetensors blob and standard JSON that round-trip every object
fusec stores, and a loader that refuses anything it did not write without running code the
entry names (issue 30, item 13)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from fusec.cache import artifacts
from test_artifact_cache import _tiny_entry


class _Evil:
    """Unpickles as a call of ``os.system`` (what a tampered pickle would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _operator_call(marker: Path) -> bytes:
    """A pickle that calls ``torch.ops.aten.from_file`` (it creates the file it names) on
    arguments of its choosing: a reviewer's repro against a restricted unpickler that allowed
    operators. Written opcode by opcode (an operator does not pickle)."""
    def text(t: str) -> bytes:
        b = t.encode()
        return b"\x8c" + bytes([len(b)]) + b
    return (b"\x80\x04" + text("torch") + text("ops.aten.from_file.default") + b"\x93"
            + text(str(marker)) + b"\x88" + b"K\x10" + b"\x87" + b"R" + b".")


def _raw_entry(payload: bytes) -> bytes:
    """An entry of fusec's layout with a valid checksum around ``payload`` (the JSON part)."""
    import hashlib
    from safetensors.torch import save
    blob = save({})
    body = len(blob).to_bytes(8, "little") + blob + payload
    return artifacts.MAGIC + hashlib.sha256(body).digest() + body


def _plain(root, table=(), shapes=()) -> bytes:
    """The JSON of an entry in :mod:`fusec.cache.entry_codec`'s plain form."""
    import json
    return json.dumps({"root": root, "table": list(table), "shapes": list(shapes)}).encode()


@pytest.mark.parametrize("attack", ["os.system", "operator_call", "builtins_eval", "cls_os_system",
                                    "cls_function", "enum_not_enum", "operator_walk", "operator_from_file",
                                    "operator_namespace", "dotted_class", "tensor_name_tuple",
                                    "torch_lazy_attr", "dunder_field", "odd_dict", "overflow_float"])
def test_an_entry_naming_code_is_refused_without_running_it(tmp_path, caplog, attack):
    """Loading an entry runs no code the entry names (issue 30, item 13): pickles that call
    ``os.system`` or an ATen operator or name ``eval`` (an entry is JSON: a pickle is not read
    as one), and JSON that names a non-IR class, a function, a constructor through the enum tag
    or a non-operator attribute, are refused with one log line, nothing runs, and the compile
    rewrites the entry."""
    import pickle
    cache = artifacts.ArtifactCache(tmp_path / "a", max_bytes=1 << 30)
    key = "e" * 64
    marker = tmp_path / "ran"
    payload = {
        "os.system": lambda: pickle.dumps({"format": artifacts.FORMAT, "x": _Evil(marker)}),
        "operator_call": lambda: _operator_call(marker),
        "builtins_eval": lambda: pickle.dumps({"x": eval}),
        "cls_os_system": lambda: _plain(("R", 0), [(0, 0, [])], [("os", "system", ())]),
        "cls_function": lambda: _plain(("R", 0), [(0, 0, [])], [("fusec.ir.graph", "_fmt", ())]),
        "enum_not_enum": lambda: _plain(("E", ("fusec.ir.graph", "Graph"), str(marker))),
        "operator_walk": lambda: _plain(("O", "aten.add.__class__")),
        "operator_from_file": lambda: _plain(("O", "aten.from_file.default")),
        "operator_namespace": lambda: _plain(("O", "evil.op")),
        "dotted_class": lambda: _plain(("E", ("fusec.ir.graph", "torch._inductor"), 0)),
        "tensor_name_tuple": lambda: _plain(("T", ("t0",))),
        "torch_lazy_attr": lambda: _plain(("D", "_dynamo")),
        "dunder_field": lambda: _plain(("R", 0), [(0, 0, [("O", "aten.neg.default")])],
                                       [("fusec.ir.graph", "Graph", ["__deepcopy__"])]),
        "odd_dict": lambda: _plain(("R", 0), [(2, ["k"])]),
        "overflow_float": lambda: b'{"root": 1e999, "table": [], "shapes": []}',
    }[attack]()
    cache.folder.mkdir(parents=True, exist_ok=True)
    cache.path(key).write_bytes(_raw_entry(payload))
    with caplog.at_level(logging.INFO, logger="fusec"):
        assert cache.load(key) is None
    assert not marker.exists()
    msgs = [r.getMessage() for r in caplog.records if "ignoring unreadable entry" in r.getMessage()]
    assert len(msgs) == 1, msgs
    assert cache.store(key, _tiny_entry(key, 10)) and cache.load(key) is not None


def test_an_entry_is_json_and_keeps_sharing():
    """What an entry holds beside its tensors is standard JSON (issue 30, item 13: no pickle, no
    NaN constant), objects shared in the entry come back shared, and bytes, tuples, non-finite
    floats and IR objects survive the round trip."""
    import json
    import math
    from fusec.ir import Graph
    g = Graph()
    shared = [1, 2]
    obj = {"format": artifacts.FORMAT, "a": shared, "b": shared, "g": g, "t": torch.arange(3),
           "bytes": b"\x00\xffcubin", "empty": b"", "tup": (1, "x", (2.5,)),
           "floats": [math.inf, -math.inf, math.nan, -0.0, 1e-300]}
    data = artifacts.dumps(obj)
    n = len(artifacts.MAGIC) + 32
    size = int.from_bytes(data[n:n + 8], "little")
    text = data[n + 8 + size:].decode()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    back = artifacts.loads(data)
    assert back["a"] is back["b"] and back["a"] == [1, 2]
    assert type(back["g"]) is Graph and torch.equal(back["t"], torch.arange(3))
    assert back["bytes"] == b"\x00\xffcubin" and back["empty"] == b"" and back["tup"] == (1, "x", (2.5,))
    f = back["floats"]
    assert f[0] == math.inf and f[1] == -math.inf and math.isnan(f[2]) and math.copysign(1, f[3]) < 0 and f[4] == 1e-300


def test_bytes_named_many_times_decode_once():
    """An entry whose JSON names one blob of bytes many times builds one bytes object, not a copy
    per name (a 1 MiB entry naming its blob 4000 times asked for 4 GiB: a try-to-break
    helper's find); the decoded objects stay bounded by the entry's size."""
    from fusec.cache import entry_codec
    blob = torch.frombuffer(bytearray(b"x" * (1 << 20)), dtype=torch.uint8)
    data = {"root": ("R", 0), "table": [(1, [["B", "t0"]] * 4000)], "shapes": []}
    import json
    back = entry_codec.decode(json.loads(json.dumps(data)), {"t0": blob})
    assert len(back) == 4000 and all(b is back[0] for b in back) and len(back[0]) == 1 << 20


def test_the_decoder_refuses_what_the_encoder_never_writes():
    """A dunder field name (``__deepcopy__`` in an IR object's dict would make ``copy.deepcopy``
    call what the entry names), a dict entry with an odd count, a number past float's range."""
    import json
    from fusec.cache import entry_codec
    bad = [{"root": ["R", 0], "table": [[0, 0, [["O", "aten.neg.default"]]]],
            "shapes": [["fusec.ir.graph", "Graph", ["__deepcopy__"]]]},
           {"root": ["R", 0], "table": [[2, ["k"]]], "shapes": []}]
    for data in bad:
        with pytest.raises(entry_codec.EntryFormatError):
            entry_codec.decode(data, {})
    with pytest.raises(ValueError, match="out-of-range"):
        json.loads('{"x": 1e999}', parse_float=artifacts._finite)


def test_a_json_nan_constant_is_refused(tmp_path, caplog):
    """An entry whose JSON holds ``NaN`` (which Python's parser would take) is unreadable: fusec
    writes non-finite floats as tagged strings, so such text was not written by it."""
    cache = artifacts.ArtifactCache(tmp_path / "a", max_bytes=1 << 30)
    key = "f" * 64
    cache.folder.mkdir(parents=True, exist_ok=True)
    cache.path(key).write_bytes(_raw_entry(b'{"root": NaN, "table": [], "shapes": []}'))
    with caplog.at_level(logging.INFO, logger="fusec"):
        assert cache.load(key) is None
    assert [r for r in caplog.records if "ignoring unreadable entry" in r.getMessage()]


def test_frozen_ir_objects_as_keys_and_members_round_trip():
    """A frozen IR object (``Ref``, ``Region``) first met as a dict key or a set member inside a
    container comes back equal: the decoder fills IR objects before containers hash them (in
    table order the container came first and hashed an empty object: the entry was written,
    then refused at every load; a try-to-break helper's find)."""
    from torch.fx.immutable_collections import immutable_dict
    from fusec.instructions.base import Region
    from fusec.ir.graph import Ref
    cases = [{Ref("x"): 1}, [{Region("a", 0, 4)}], [frozenset({Ref("a")})], {("k", Ref("a")): 2},
             [immutable_dict({Ref("a"): 1})]]
    for obj in cases:
        assert artifacts.loads(artifacts.dumps(obj)) == obj, obj
