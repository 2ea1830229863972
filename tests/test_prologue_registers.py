"""A folded prologue in registers (fusec/instructions/prologue_regs.py, the knob
FUSEC_PROLOGUE_REGS): which prologues take it (the post-norm, scaled-residual and embedding-scale
families) and which keep the shared-memory form, the form's code (loads up front, the members
inline, one barrier), a kernel at Gemma-2's width (2304: not a multiple of the CTA's 512
threads) compiling without spills, and on the GPU the same logits bit for bit as the
shared-memory form."""
from __future__ import annotations

import re

import pytest
import torch

import hf_tiny
import step_util
from fusec.cuda.codegen import Buffers, render
from fusec.instructions import prologue, prologue_regs

def _forms(s) -> list[tuple[str, bool]]:
    """(kind, has a register form) of each folded op of the lowered step ``s``."""
    bufs = Buffers(s.graph, counter_base=len(s.graph.ops))
    return [(o.kind, prologue_regs.register_form(o, s.graph, bufs) is not None)
            for o in s.graph.ops if prologue.has(o)]


def _register_blocks(source: str) -> dict[str, str]:
    """The register forms' functions of a rendered kernel: name -> body."""
    return dict(re.findall(r"__device__ __noinline__ void (gx_prologue_\w+)\([^)]*\) \{\n([\s\S]*?)\n\}  // \1\n",
                           source))


@pytest.mark.parametrize("factory", [hf_tiny.olmo2, hf_tiny.gemma2, hf_tiny.granite, hf_tiny.gemma3])
def test_post_norm_and_scaled_residual_prologues_run_in_registers(factory):
    """Every folded prologue of these families (norms, adds, scales: elementwise members and
    RMSNorms over the hidden vector) has a register form: a function of its own that the case
    calls, then one barrier; the function loads its external inputs in the first loop, before
    any member, runs the members inline (no generated function called, no barrier but the norms'
    reductions') and stores x to shared memory only where ``gx_in`` says the element is one."""
    s = step_util.lowered(factory().to(torch.bfloat16))
    forms = _forms(s)
    assert forms and all(ok for _, ok in forms), forms
    source = render(s).source
    blocks = _register_blocks(source)
    calls = re.findall(r"#if FUSEC_PROLOGUE_REGS\n(gx_prologue_\w+)\(.*\); __syncthreads\(\);\n#else\n", source)
    assert blocks and calls and set(calls) == set(blocks)
    assert source.count("#if FUSEC_PROLOGUE_REGS") == len(calls)
    for b in blocks.values():
        lines = b.splitlines()   # gx_in's default, the arrays, the pragma, the loads
        assert "gx_ldcg(" in lines[3] and "(gx_in ? i : 0)" in lines[3], lines[:4]
        assert not any("gx_ld" in ln for ln in lines[4:]), b                 # no load after them
        assert "__syncthreads()" not in b and not re.search(r"gx_\w+_[0-9a-f]{10}\(", b), b
        assert "bufs[" not in b and "if (gx_in) ((__nv_bfloat16*)smem)[i] =" in b


def test_a_reduction_other_than_a_norm_keeps_the_shared_memory_form():
    """A member reduction the register form does not mask (here ``x - x.mean(-1)`` in front of
    Llama's final norm: ``aten.mean`` would add the padding elements of a thread's last round)
    keeps the prologue in shared memory (no ``#if``), the kernel compiling as before."""
    from torch import nn

    class Centered(nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.norm = norm

        def forward(self, x):
            return self.norm(x - x.mean(-1, keepdim=True))

    model = hf_tiny.llama()
    model.model.norm = Centered(model.model.norm)
    s = step_util.lowered(model.to(torch.bfloat16))
    assert _forms(s) == [("rms_lm_head", False)]
    assert "#if FUSEC_PROLOGUE_REGS" not in render(s).source


def test_a_broadcast_scalar_input_is_read_from_memory_in_the_register_form():
    """A member that reads a one-element tensor (a learned scale in front of the final norm,
    broadcast to every element) reads it from global memory inside the register form, at element
    0 where the round's element is past the vector (a broadcast's offset could pass its
    tensor's end there); the hidden vector's tensors stay in registers."""
    from torch import nn

    class Scaled(nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.norm = norm
            self.scale = nn.Parameter(torch.tensor([1.5]))

        def forward(self, x):
            return self.norm(x * self.scale)

    model = hf_tiny.llama()
    model.model.norm = Scaled(model.model.norm)
    s = step_util.lowered(model.to(torch.bfloat16))
    assert _forms(s) == [("rms_lm_head", True)]
    (block,) = _register_blocks(render(s).source).values()
    assert re.search(r"__restrict__ p\d+ = ", block) and "+ (gx_in ? (0) : 0))" in block, block


def test_register_form_compiles_without_spills_at_gemma2_width(tmp_path):
    """Two layers of Gemma-2-2B's widths (hidden 2304: five rounds of 512 threads, the last
    partial; head_dim 256, MLP 9216; a small vocabulary) bf16: every prologue in registers, and the
    kernel and its functions (the register forms' among them) compile with NVRTC for sm_90a
    without spills. Inline in the kernel's dispatch loop with a branch around each round's
    body, the register form took this kernel to 128 registers and 8 B of spills (in its split-KV
    attention: 8 -> 12 µs a layer on an H100); inline without the branch, fp32 Gemma-3's kernel
    still spilled (tests/test_qk_head_norms.py). As a function of its own it leaves the kernel's
    registers alone."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    from fusec.cuda.jit import compile_cuda
    torch.manual_seed(0)
    cfg = Gemma2Config(hidden_size=2304, intermediate_size=9216, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=256, vocab_size=512, sliding_window=4096,
                       max_position_embeddings=256, attn_implementation="sdpa")
    model = Gemma2ForCausalLM(cfg).eval().requires_grad_(False).to(torch.bfloat16)
    s = step_util.lowered(model)
    forms = _forms(s)
    assert forms and all(ok for _, ok in forms), forms
    source = render(s).source
    res = compile_cuda(source, "fusec_step.cu", cache_dir=str(tmp_path)).resources
    assert all(r["spill_store_bytes"] == r["spill_load_bytes"] == 0 for r in res.values()), res
    assert any(name.startswith("_Z") and "gx_prologue_" in name for name in res), list(res)


def test_fp32_member_outputs_are_not_contracted_into_the_next_member():
    """fp32 OLMo-2 (``rmsnorm > add``, and ``> rmsnorm`` before the LM head): in each register
    form's PTX, from the post-norm's rsqrt to the residual add, the weight's product and the add
    stay two instructions (the member outputs pass through ``gx_opaque``); without it NVVM
    contracted them into one ``fma.rn.f32``, an unrounded product that neither eager nor the
    shared-memory form has."""
    from fusec.cuda.jit import compile_ptx
    s = step_util.lowered(hf_tiny.olmo2().to(torch.float32))
    ptx = compile_ptx(render(s).source)
    fns = re.findall(r"\.func\s+\S*gx_prologue_\w+\([\s\S]*?\n\}\n", ptx)
    assert fns
    for f in fns:
        tail = f[f.index("rsqrt.approx"):]
        assert "add.f32" in tail
        tail = tail[:tail.index("add.f32")]
        assert "mul.f32" in tail and "fma.rn.f32" not in tail, tail


@pytest.mark.gpu
@pytest.mark.parametrize("factory, dtype", [(hf_tiny.olmo2, torch.bfloat16), (hf_tiny.gemma2, torch.bfloat16),
                                            (hf_tiny.granite, torch.bfloat16), (hf_tiny.gemma3, torch.bfloat16),
                                            (hf_tiny.olmo2, torch.float32), (hf_tiny.gemma2, torch.float32)])
def test_register_form_gives_the_shared_memory_forms_logits_on_the_gpu(factory, dtype):
    """On the GPU, default options, six decode steps, each token through the kernel with the
    register form (default), the kernel with ``FUSEC_PROLOGUE_REGS=0`` and eager in turn, each
    on its own StaticCache after the same prompt: bf16 logits the same bit for bit (the same ops,
    roundings and summation order; fp32 within 1e-6 relative), both forms' error to eager at
    most 1.5x bf16 eager's own to an fp32 copy (plus 1e-3, as tests/test_gpu_families.py), no
    fallback. The tiny models' hidden vector (64) is one partial round: every element past it
    masked."""
    import copy
    from transformers import StaticCache
    from fusec.fallbacks import FallbackWatch
    ref = factory().cuda()
    model = copy.deepcopy(ref).to(dtype)
    gen = torch.Generator().manual_seed(12)
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(4)]
    p = torch.randint(0, 128, (1, 5), generator=gen).cuda()
    with torch.no_grad():
        ref(input_ids=p, past_key_values=caches[0], use_cache=True)
        for c in caches[1:]:
            model(input_ids=p, past_key_values=c, use_cache=True)
    torch._dynamo.reset()
    regs = torch.compile(model, backend="fusec")
    shm = torch.compile(copy.deepcopy(model), backend="fusec", options={"defines": {"FUSEC_PROLOGUE_REGS": 0}})
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(6):
            t = torch.randint(0, 128, (1, 1), generator=gen).cuda()
            r = ref(input_ids=t, past_key_values=caches[0], use_cache=True).logits.double()
            a = regs(input_ids=t, past_key_values=caches[1], use_cache=True).logits
            b = shm(input_ids=t, past_key_values=caches[2], use_cache=True).logits
            e = model(input_ids=t, past_key_values=caches[3], use_cache=True).logits.double()
            if dtype == torch.bfloat16:
                assert torch.equal(a, b)
            else:
                assert step_util.rel(a.double(), b.double()) < 1e-6
            eager_err = step_util.rel(e, r)
            for x in (a, b):
                assert step_util.rel(x.double(), r) <= 1.5 * eager_err + 1e-3, (step_util.rel(x.double(), r), eager_err)
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled >= 2, w.fallbacks
