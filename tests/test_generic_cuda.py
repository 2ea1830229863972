"""Generated CUDA forms of generic ops (fusec/cuda/gen), without a GPU.

* every ATen op fusec accepts and every semantic op kind has an emitter;
* the op zoo (tests/generic_zoo.py) and real decode-step graphs: each op's generated function,
  compiled as host C++ (tests/gen_host.py), against PyTorch on the same inputs;
* the kernels of tiny HF models of several families, fully fused and with ``max_fusions=0``
  (every op generic), and of the zoo, render and compile with NVRTC for sm_90a.
"""
from __future__ import annotations

import pytest
import torch

import generic_zoo
import hf_tiny
import step_util
from fusec.cuda.codegen import render
from fusec.cuda.gen import find_emitter, generate
from gen_host import check_graph, compiler
from fusec.errors import FallbackRequired
from fusec.instructions import KINDS
from fusec.instructions import generic as gen_mod
from fusec.cuda.jit import compile_cuda
from fusec.passes import schedule, tile

needs_cxx = pytest.mark.skipif(compiler() is None, reason="needs a host C++ compiler")
FAMILIES = ["llama", "qwen3", "qwen2_bias", "gemma", "phi3_fused", "gpt_neox", "olmo2", "granite",
            "mistral_sw", "gemma2", "gemma3", "falcon", "gpt2", "phi2", "starcoder2"]


def test_every_accepted_op_and_semantic_kind_has_a_cuda_form():
    names = gen_mod._ELEMENTWISE | gen_mod._REDUCE | gen_mod._MATVEC | gen_mod._DATA
    missing = sorted(n for n in names if find_emitter(f"aten.{n}.default") is None)
    assert not missing, missing
    assert find_emitter("prims.convert_element_type.default") and find_emitter("fusec.sdpa.default")
    from fusec.ir.semantics import SEMANTICS
    kinds = [k for k in SEMANTICS if k not in KINDS and k != "table_lookup"]   # table_lookup: generic.cu.j2
    assert not [k for k in kinds if find_emitter(k) is None]


def _zoo(dtype=torch.float32):
    return step_util.capture(generic_zoo.Zoo(), generic_zoo.inputs(dtype=dtype))


@needs_cxx
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_zoo_ops_on_the_host_match_torch(dtype, tol, tmp_path):
    """Every op of the zoo's graph (~235, dozens of kinds), run by its generated function on
    the host from PyTorch's inputs: error relative to the output's largest magnitude (bf16:
    PyTorch's CPU kernels round some ops differently than the CUDA ones we follow)."""
    _, g, flat = _zoo(dtype)
    with torch.no_grad():
        res = check_graph(g, flat, workdir=tmp_path)
    assert len(res) == len(g.ops) > 200
    bad = [r for r in res if not r.max_err <= tol]
    assert not bad, bad


def test_zoo_kernel_compiles_with_nvrtc():
    """The zoo's raw graph (no passes: views and all) scheduled as generic instructions: it
    compiles without spills or NVRTC warnings."""
    _, g, _ = _zoo()
    plan = render(schedule.run(g, tile.run(g, 8), 8))
    assert "gx_topk_" in plan.source and "gx_sdpa_" in plan.source and "gx_index_put_" in plan.source
    k = compile_cuda(plan.source, "fusec_step.cu")
    assert k.resources["fusec_step"]["spill_store_bytes"] == 0
    assert "warning" not in k.log, k.log   # e.g. a coordinate or a query row no line reads


def _decode_inputs(name):
    model = getattr(hf_tiny, name)()
    cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 4)), past_key_values=cache, use_cache=True)
    return model, {"input_ids": torch.randint(0, 128, (1, 1)), "past_key_values": cache, "use_cache": True}


@pytest.mark.parametrize("name", FAMILIES)
def test_family_kernels_compile_fused_and_unfused(name, tmp_path, monkeypatch):
    """Default options (through compile_model) and max_fusions=0 (nothing fused: every op is a
    generic instruction; the passes run on the graph compile_model captured, as compile_model
    would) render and compile with NVRTC, no FallbackRequired; with a host compiler, every op of
    the captured graph and of the unfused lowered graph matches PyTorch on the host."""
    from fusec.api import compile_model
    from fusec.config import Options
    from fusec.pipeline import Dumper, lower
    from fusec.cache import artifacts
    model, kw = _decode_inputs(name)
    captured = []   # compile_model's captured IR and flat inputs: one capture (~1 s) serves both
    compile_graph = artifacts.compile_graph

    def keep(g, flat, *args, **kwargs):
        captured.append((g, list(flat)))
        return compile_graph(g, flat, *args, **kwargs)
    keep.keeps_cache = True   # only records: the run-wide artifact cache stays on (conftest.py)
    monkeypatch.setattr(artifacts, "compile_graph", keep)
    fused = compile_model(model, (), kw, {"num_sms": 16, "max_fusions": None}).schedule
    ((g, flat),) = captured
    unfused = lower(g, flat, Options.from_dict({"num_sms": 16, "max_fusions": 0}), Dumper(None))
    for sched in (fused, unfused):
        compile_cuda(render(sched).source, "fusec_step.cu")
    kinds = unfused.graph.count_kinds()
    assert not {k for k in kinds if k in KINDS} - {"layernorm"}, kinds   # nothing fused
    if compiler() is None:
        return
    low = unfused.graph
    for graph, sub in ((g, "raw"), (low, "low")):
        (tmp_path / sub).mkdir()
        with torch.no_grad():
            checks = check_graph(graph, flat, workdir=tmp_path / sub)
        bad = [r for r in checks if not r.max_err <= 1e-5]
        assert checks and not bad, bad


@needs_cxx
def test_bf16_gemma_unfused_ops_on_the_host(tmp_path):
    """bf16 Gemma unfused: rmsnorm with the weight in fp32 (w_fp32), gelu_mul's rounding."""
    from fusec.config import Options
    from fusec.pipeline import Dumper, lower
    model, kw = _decode_inputs("gemma")
    model = model.to(torch.bfloat16)
    cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 4)), past_key_values=cache, use_cache=True)
    kw["past_key_values"] = cache
    _, g, flat = step_util.capture(model, kw)
    low = lower(g, flat, Options.from_dict({"num_sms": 16, "max_fusions": 0}), Dumper(None)).graph
    assert any(o.kind == "rmsnorm" and o.attrs.get("w_fp32") for o in low.ops)
    with torch.no_grad():
        checks = check_graph(low, flat, workdir=tmp_path)
    bad = [r for r in checks if not r.max_err <= 1e-2]
    assert not bad, bad


@needs_cxx
def test_bf16_fmod_and_remainder_round_their_scalar(tmp_path):
    """bf16 ``fmod``/``remainder`` by a Python float: PyTorch rounds the scalar to bf16 first
    (0.7 -> 0.69921875); the generated code does too, exactly (before: max error 1.0 of the
    output's magnitude, on inputs of about +-20)."""
    class F(torch.nn.Module):
        def forward(self, xb):
            return torch.fmod(xb, 0.7), torch.remainder(xb, 0.7), torch.fmod(xb, -1.3)

    xb = (torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 20).to(torch.bfloat16)
    _, g, flat = step_util.capture(F(), {"xb": xb})
    with torch.no_grad():
        checks = check_graph(g, flat, workdir=tmp_path)
    assert len(checks) == 3 and all(r.max_err == 0 for r in checks), checks


def test_default_llama_kernel_has_no_generated_ops():
    """Fully fused models keep their kernel text: no generated section, no helpers."""
    from fusec.api import compile_model
    model, kw = _decode_inputs("llama")
    src = render(compile_model(model, (), kw, {"num_sms": 16}).schedule).source
    assert "gx_" not in src and "generated generic ops" not in src


def test_inexpressible_op_names_op_and_source():
    """fp64 has no CUDA type in fusec: FallbackRequired naming the op and its source line."""
    class M(torch.nn.Module):
        def forward(self, x):
            return (x.double() * 2).float()
    _, g, _ = step_util.capture(M(), {"x": torch.randn(4)})
    with pytest.raises(FallbackRequired) as e:
        render(schedule.run(g, tile.run(g, 2), 2))
    msg = str(e.value)
    assert "_to_copy" in msg and "float64" in msg and "test_generic_cuda.py" in msg


def test_unknown_kind_is_not_implemented():
    from fusec.cuda.codegen import Buffers
    from fusec.ir import Graph, Op, TensorInfo
    g = Graph()
    g.add_tensor(TensorInfo("a", (2,), torch.float32))
    op = Op("o", "mystery_kind", {"x": "a"}, {"out": "a"}, source="m.py:3 y = mystery(x)")
    with pytest.raises(NotImplementedError, match=r"mystery_kind.*m\.py:3"):
        generate(op, g, Buffers(g))
