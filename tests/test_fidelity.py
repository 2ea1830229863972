"""Verification ladder step 0: the IR executor reproduces the captured graph after every pass."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
import step_util
from fusec.ir import Role
from fusec.passes import fold_position, fuse, normalize, recognize
from fusec.ir.semantics import execute


@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_every_stage_computes_the_captured_function(factory):
    model = factory()
    cache = hf_tiny.static_cache(model, 24)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 5)), past_key_values=cache, use_cache=True)
    aten_gm, g, flat = step_util.capture(model, {"input_ids": torch.randint(0, 128, (1, 1)),
                                        "past_key_values": cache, "use_cache": True})
    flat = [a.clone() for a in flat]
    weights = {n: a for n, a in zip(g.inputs, flat) if g.tensors[n].role == Role.WEIGHT}

    def run(graph):
        args = [a.clone() for a in flat]
        with torch.no_grad():
            outs = execute(graph, args)
        return outs, args

    want_args = [a.clone() for a in flat]
    with torch.no_grad():
        want = aten_gm(*want_args)
    stages = [("capture", lambda x: x), ("normalize", normalize.run),
              ("recognize", lambda x: recognize.run(x, weights)),
              ("fold_position", lambda x: fold_position.run(x, weights)),
              ("fuse", lambda x: fuse.run(x, 8))]
    for name, fn in stages:
        g = fn(g)
        g.check(name)
        outs, args = run(g)
        for o, w in zip(outs, want):
            assert torch.isfinite(o).all(), name
            assert ((o - w).norm() / w.norm()).item() < 1e-5, name
        for a, w, info in zip(args, want_args, (g.tensors[n] for n in g.inputs)):
            if info.role in (Role.KV_CACHE, Role.STATE):   # in-place writes reach the caller's tensors
                torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6, msg=name)
    assert "rms_qkv_rope" in g.count_kinds()
