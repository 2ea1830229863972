"""Large unfused elementwise ops are split into tiles of output ranges over many SMs
(:func:`fusec.instructions.generic.ranged`): Gemma-2's final logit softcap (a division, a tanh
and a multiplication over the vocabulary) and an MLP's silu(gate) * up, which ran on one SM each.

CPU: which ops split and how (exact, disjoint ranges), the simulator against eager with the
hazard check on, the generated functions on the host, the kernel through NVRTC.
GPU: the same model's compiled step against eager."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.instructions.generic import RANGE_CHUNK, ranged

VOCAB = 8192


def _gemma2():
    """A Gemma-2 with a vocabulary of 8192 (its logit softcap ops split), fp32, random norms."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    m = hf_tiny._small(Gemma2Config, Gemma2ForCausalLM, 0, vocab_size=VOCAB, intermediate_size=4096,
                       head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                       attn_logit_softcapping=None, sliding_window=16, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2)
    return hf_tiny._nonzero_norms(m, 0)


def _inputs(model, gen):
    cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (1, 4), generator=gen), past_key_values=cache, use_cache=True)
    return {"input_ids": torch.randint(0, VOCAB, (1, 1), generator=gen), "past_key_values": cache,
            "use_cache": True}


def _split_ops(g) -> list:
    """The ops split into ranges: ranged ops standing alone and ranged chains' members
    (tests/test_chain_ranged.py)."""
    return [m for o in g.ops for m in (o.attrs["ops"] if o.attrs.get("ranged") else [o]) if ranged(m, g)]


def test_large_elementwise_ops_split_into_disjoint_output_ranges():
    """The softcap's ops split (as one ranged chain of the same ranges since the chain pass takes
    them); each split op or chain has min(SMs, n / RANGE_CHUNK) tiles, disjoint and covering n."""
    from fusec.api import compile_model
    gen = torch.Generator().manual_seed(0)
    model = _gemma2()
    res = compile_model(model, (), _inputs(model, gen), {"num_sms": 16})
    g, s = res.graph, res.schedule
    split = _split_ops(g)
    kinds = {o.kind.split(".")[1] if o.kind.startswith("aten.") else o.kind for o in split}
    assert {"div", "tanh", "mul"} <= kinds, kinds           # the softcap: logits / 30, tanh, * 30
    units = [o for o in g.ops if ranged(o, g) or o.attrs.get("ranged")]
    for o in units:
        n = o.attrs["ranged"] if o.kind == "chain" else g.tensors[o.outputs["out"]].numel
        tiles = sorted((i.tile for i in s.instrs if i.op == o.name), key=lambda t: t.params["rows"])
        assert len(tiles) == min(16, n // RANGE_CHUNK) >= 2
        assert tiles[0].params["rows"][0] == 0 and tiles[-1].params["rows"][1] == n
        assert all(a.params["rows"][1] == b.params["rows"][0] for a, b in zip(tiles, tiles[1:]))
        assert all(t.writes[0].stop - t.writes[0].start == t.params["rows"][1] - t.params["rows"][0] for t in tiles)
    # a chain's members and a folded prologue's too
    ops = [m for o in g.ops for m in (o.attrs["ops"] if o.kind == "chain" else [*o.attrs.get("pre", ()), o])]
    small = [o for o in ops if o.kind.startswith("aten.add") and g.tensors[o.outputs["out"]].numel < 2 * RANGE_CHUNK]
    assert small and not any(ranged(o, g) for o in small)


def test_fused_gate_up_mlp_silu_mul_splits():
    """An MLP's silu(gate) * up left unfused (``max_fusions=0``: since ``split_linear``, Phi-3's
    fused gate_up projection, which this test relied on, becomes rms_gate_up_silu as Llama's
    does, and OLMo-2's separate gate and up before it): with an intermediate of 4096 it splits
    into two ranges."""
    from transformers import Phi3Config, Phi3ForCausalLM
    from fusec.api import compile_model
    gen = torch.Generator().manual_seed(4)
    model = hf_tiny._small(Phi3Config, Phi3ForCausalLM, 0, intermediate_size=4096, pad_token_id=0,
                           eos_token_id=1, bos_token_id=1)
    cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 4), generator=gen), past_key_values=cache, use_cache=True)
    res = compile_model(model, (), {"input_ids": torch.randint(0, 128, (1, 1), generator=gen),
                                    "past_key_values": cache, "use_cache": True}, {"num_sms": 16, "max_fusions": 0})
    silu = [o for o in res.graph.ops if o.kind == "silu_mul"]
    assert silu and all(ranged(o, res.graph) for o in silu)
    assert all(sum(i.op == o.name for i in res.schedule.instrs) == 2 for o in silu)


def test_split_ops_match_eager_on_the_simulator():
    """Four decode steps, fp32, hazard check on (the default): relative logits error ≤ 1e-4, no
    fallback; a split op's tile writes only its range (the rest stays poison until its tile)."""
    from fusec.fallbacks import FallbackWatch
    gen = torch.Generator().manual_seed(1)
    model = _gemma2()
    kw = _inputs(model, gen)
    ref_cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(1)),
              past_key_values=ref_cache, use_cache=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 16})
    errs = []
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(4):
            t = torch.randint(0, VOCAB, (1, 1), generator=gen)
            a = compiled(input_ids=t, past_key_values=kw["past_key_values"]).logits.double()
            b = model(input_ids=t, past_key_values=ref_cache).logits.double()
            errs.append(((a - b).norm() / b.norm()).item())
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks
    assert max(errs) <= 1e-4 and min(errs) > 0, errs


def test_split_ops_generated_code_on_the_host_and_nvrtc(tmp_path):
    """The split ops' functions take their range (``gx_lo``, ``gx_hi`` from the instruction
    word's p0, p1), compile with NVRTC, and run whole on the host as PyTorch computes."""
    from fusec.api import compile_model
    from fusec.config import Options
    from fusec.cuda.codegen import render
    from gen_host import check_graph, compiler
    from fusec.cuda.jit import compile_cuda
    from fusec.pipeline import Dumper, lower
    import step_util
    gen = torch.Generator().manual_seed(2)
    model = _gemma2()
    kw = _inputs(model, gen)
    res = compile_model(model, (), kw, {"num_sms": 16})
    plan = render(res.schedule)
    assert "int gx_lo, int gx_hi" in plan.source and "in.p0, in.p1)" in plan.source
    compile_cuda(plan.source, "fusec_step.cu")
    if compiler() is None:
        pytest.skip("no host C++ compiler for the host check")
    _, g, flat = step_util.capture(model, kw)
    low = lower(g, flat, Options.from_dict({"num_sms": 16}), Dumper(None)).graph
    with torch.no_grad():
        checks = check_graph(low, flat, workdir=tmp_path)
    split = {o.name for o in _split_ops(low)}
    assert split and split <= {r.op for r in checks}
    assert all(r.max_err <= 1e-5 for r in checks), [r for r in checks if not r.max_err <= 1e-5]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_ops_on_the_gpu_match_eager():
    """Six decode steps of the compiled Gemma-2 (fp32, default options, one megakernel) against
    eager: relative logits error ≤ 1e-4, no fallback."""
    import step_util
    errs, w = step_util.steps_against_eager(_gemma2().cuda(), VOCAB, seed=3)
    assert not w.fallbacks and w.compiled >= 1, w.fallbacks
    assert max(errs) <= 1e-4, errs


def test_the_simulator_computes_a_ranged_op_once_per_step(monkeypatch):
    """Each of a ranged op's tiles writes its range of the op computed whole; the simulator
    computes it once per step for all of them (``Env.memo``), not once per tile: Gemma-2's
    256000-logit softcap over 132 tiles made a 2-layer step take 13-18 s. One simulated step:
    one whole computation per ranged op, and the step still matches eager."""
    from fusec.api import compile_model
    from fusec.ir import semantics
    calls: dict[str, int] = {}
    real = semantics.run_op

    def counting(op, env):
        calls[op.name] = calls.get(op.name, 0) + 1
        return real(op, env)
    monkeypatch.setattr(semantics, "run_op", counting)
    model = _gemma2()
    res = compile_model(model, (), _inputs(model, torch.Generator().manual_seed(2)), {"num_sms": 16, "simulate": True})
    assert "match eager" in res.simulated, res.simulated
    split = [o.name for o in _split_ops(res.graph)]
    assert split and all(calls.get(n) == 1 for n in split), {n: calls.get(n) for n in split}
