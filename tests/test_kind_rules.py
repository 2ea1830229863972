"""One source of truth per kind: fusion rules live with the kind's class, fuse.py knows no kind,
and a kind's declared call agrees with its template's device function."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fusec.instructions import KINDS, Instruction, register
from fusec.instructions.rule import Rule, rules_in_order
from fusec.ir import Op
from fusec.ir.pattern import lit, op, var
from fusec.passes import fuse
from step_util import neg_mul_graph

ROOT = Path(__file__).resolve().parent.parent


def test_rules_are_declared_on_their_classes():
    rules = rules_in_order(KINDS)
    assert len({r.priority for r in rules}) == len(rules), "equal priorities: the order would be registration order"
    owners = {r.kind for r in rules}
    assert {"rms_qkv_rope", "attention_partial", "rms_gate_up_silu", "matvec_residual", "rms_lm_head", "matvec",
            "embedding"} <= owners
    for name in owners:
        assert "rules" in vars(KINDS[name]), f"{name}'s rules are not declared on its class"
        assert all(r.kind == name for r in vars(KINDS[name])["rules"])


def test_fuse_pass_names_no_kind():
    """Outside docstrings, passes/fuse.py holds no string that is a kind or an anchor kind."""
    tree = ast.parse((ROOT / "passes" / "fuse.py").read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(n) is not None}
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and id(n) not in docs}
    names = set(KINDS) | {k for r in rules_in_order(KINDS) for k in r.anchor_kinds()} | {"linear", "rmsnorm", "rope"}
    assert not strings & names, strings & names


@pytest.fixture
def toy_kind():
    """A kind registered from the test: ``-x * k`` in one op, by a declarative rule."""
    class ToyNegScale(Instruction):
        name = "toy_neg_scale"
        rules = (Rule(op("aten.mul.Tensor", op("aten.neg.default", var("x")), lit("k")),
                      inputs={"x": "x"}, outputs={"out": "_anchor.out"},
                      attrs=lambda g, m: {"k": m["k"]}, check=lambda g, m: m["k"] != 0, priority=5),)
    register(ToyNegScale)
    yield ToyNegScale
    del KINDS[ToyNegScale.name]


def test_a_kind_registered_from_a_test_fuses(toy_kind):
    g = fuse.run(neg_mul_graph(), num_sms=4)
    (o,) = g.ops
    assert (o.kind, o.inputs, o.outputs, o.attrs) == ("toy_neg_scale", {"x": "x"}, {"out": "z"}, {"k": 2.0})


def test_fuse_keeps_a_subgraph_whose_inner_tensor_is_read_outside(toy_kind):
    g = neg_mul_graph()
    g.outputs = ["z", "y"]      # y is read outside the subgraph
    assert [o.kind for o in fuse.run(g, num_sms=4).ops] == ["aten.neg.default", "aten.mul.Tensor"]
    assert [o.kind for o in fuse.run(neg_mul_graph(), num_sms=4, max_fusions=0).ops] == \
        ["aten.neg.default", "aten.mul.Tensor"]


def _template_params(kind: str, fn: str) -> list[str]:
    """The template parameters of device function ``fn`` in ``templates/<kind>.cu.j2``."""
    text = (ROOT / "templates" / f"{kind}.cu.j2").read_text()
    m = re.search(r"template <([^>]*)>\s*__device__[^(]*\b" + fn + r"\(", text)
    assert m, f"{fn} not found in {kind}.cu.j2"
    return [p.strip() for p in m.group(1).replace("\n", " ").split(",")]


@pytest.mark.parametrize("kind", sorted(k for k, c in KINDS.items() if c.call is not None))
def test_declared_call_matches_the_template(kind):
    """Each variant's template arguments: one per template parameter (those left out have a C++
    default), and a declared default is the template's default."""
    call = KINDS[kind].call
    fns = [call.fn] if isinstance(call.fn, str) else [call.fn(Op("o", kind, {}, {"out": "t", "token": "t"})),
                                                      call.fn(Op("o", kind, {}, {}))]
    for fn in fns:
        params = _template_params(kind, fn)
        variant = {"out": "t", "token": "t"} if fn.endswith(("_merge", "_argmax")) else {}
        probe = Op("o", kind, {"mask": "m", "bq": "b"}, variant)
        targs = [a for a in call.targs if a.when is None or a.when(probe)]
        assert len(targs) == len(params), (fn, [a.name for a in targs], params)
        for a, p in zip(targs, params):
            if a.default is not None:
                assert "=" in p and p.split("=")[1].strip() == str(a.default), (fn, a.name, p)
