"""Decoder families beyond Llama/Qwen3 on the CPU simulator: fused where a fast kind covers
them, correct against eager everywhere, kernel emitted with NVRTC."""
from __future__ import annotations

import pytest
import torch

from fusec.fallbacks import FallbackWatch


def qwen2(vocab=128):
    """Tiny Qwen2 (q/k/v biases, made non-zero), fp32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256,
                      attn_implementation="sdpa", tie_word_embeddings=True)
    m = Qwen2ForCausalLM(cfg).eval().requires_grad_(False)
    for layer in m.model.layers:
        for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            p.bias.normal_(generator=torch.Generator().manual_seed(1))
    return m


def phi3(vocab=128):
    """Tiny Phi-3 (fused qkv and gate_up weights, pad_token_id set), fp32."""
    from transformers import Phi3Config, Phi3ForCausalLM
    torch.manual_seed(0)
    cfg = Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256, pad_token_id=0,
                     eos_token_id=1, bos_token_id=1, attn_implementation="sdpa")
    return Phi3ForCausalLM(cfg).eval().requires_grad_(False)




def _decode_against_eager(model, n=8):
    from transformers import StaticCache
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    p = torch.randint(0, vocab, (1, 4), generator=gen)
    for c in caches:
        model(input_ids=p, past_key_values=c, use_cache=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 16})
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(n):
            tok = torch.randint(0, vocab, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
            rel = ((a - b).norm() / b.norm()).item()
            assert 0 < rel < 1e-4, rel
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks


def test_qwen2_bias_fuses_into_rms_qkv_rope(steps):
    """Qwen2's q/k/v biases ride in rms_qkv_rope (added before the projection's rounding):
    every layer is the fast kinds, and the kernel compiles."""
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    _decode_against_eager(qwen2())
    (step,) = steps
    kinds = step.schedule.graph.count_kinds()
    assert kinds["rms_qkv_rope"] == 2 and kinds["attention_partial"] == 2
    assert {k for k in kinds if k.startswith("aten.") or k in ("linear", "rmsnorm", "rope")} <= {"aten.copy_.default"}
    src = render(step.schedule).source
    assert ", true, float>" in src   # the BIAS instantiation
    assert compile_cuda(src, "fusec_step.cu").resources["fusec_step"]["spill_store_bytes"] == 0


def test_phi3_fused_qkv_compiles_and_matches(steps):
    """Phi-3 slices one fused qkv projection (and passes an empty rotary remainder to cat): it
    used to crash the compiler; it now matches eager. Its fused qkv and gate_up projections are
    split into linears over row views of their weights (``split_linear``), so each layer is
    Llama's kinds: rms_qkv_rope and rms_gate_up_silu, no slice, split, rope or KV write left."""
    _decode_against_eager(phi3())
    assert steps and not steps[0].fallen_back
    kinds = steps[0].schedule.graph.count_kinds()
    assert kinds["rms_qkv_rope"] == 2 and kinds["rms_gate_up_silu"] == 2 and kinds["rms_lm_head"] == 1, kinds
    assert not {k for k in kinds if k.startswith("aten.") or k in ("linear", "rope", "kv_write", "silu_mul")} \
        - {"aten.copy_.default"}, kinds


def olmo2(vocab=128):
    """Tiny OLMo-2 (q/k RMSNorm over the whole projection, post-norms), fp32."""
    from transformers import Olmo2Config, Olmo2ForCausalLM
    torch.manual_seed(0)
    cfg = Olmo2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256, pad_token_id=0,
                      eos_token_id=1, attn_implementation="sdpa")
    return Olmo2ForCausalLM(cfg).eval().requires_grad_(False)


def test_unfused_linears_become_matvec(steps):
    """A post-norm family (OLMo-2: no norm in front of the q/k/v or the MLP, q/k norms over the
    whole projection) still streams every projection over all SMs: no linear is left generic
    (q/k/v in ``rms_qkv_rope`` without its RMSNorm, gate/up in rms_gate_up_silu without its
    norm, O and down as matvecs)."""
    _decode_against_eager(olmo2())
    (step,) = steps
    kinds = step.schedule.graph.count_kinds()
    assert "linear" not in kinds and kinds["matvec"] >= 2 * 2 and kinds["rms_qkv_rope"] >= 2
    per_op = {}
    for ins in step.schedule.instrs:
        per_op.setdefault(ins.op, set()).add(ins.sm)
    mv = [o.name for o in step.schedule.graph.ops if o.kind in ("matvec", "rms_qkv_rope", "rms_gate_up_silu")]
    assert all(len(per_op[name]) > 1 for name in mv)   # tiled over several SMs, unlike a generic op


def test_post_norm_mlp_fuses_gate_up_and_product_without_the_norm(steps):
    """OLMo-2's MLP reads the residual stream (no norm in front of gate/up): gate, up and
    silu(gate) * up are one rms_gate_up_silu per layer with the norm off (no norm_w, no eps: the
    rows dot with x itself), no silu_mul is left, the step matches eager with no fallback, and
    the kernel (bf16, the NORM=false instantiation; its folded post-norm and add off: they are
    tests/test_prologue.py's) compiles for sm_90a without spills."""
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    import step_util
    _decode_against_eager(olmo2())
    (step,) = steps
    g = step.schedule.graph
    kinds = g.count_kinds()
    assert kinds["rms_gate_up_silu"] == 2 and "silu_mul" not in kinds, kinds
    for o in (o for o in g.ops if o.kind == "rms_gate_up_silu"):
        # x: its input, or (by default) the post-norm and residual add folded into it compute it
        ins = {s for s in o.inputs if not s.startswith("pre_in")} | ({"x"} if "pre" in o.attrs else set())
        assert o.attrs["norm"] is False and o.attrs["act"] == "silu" and ins == {"x", "wg", "wu"}
        assert o.source.startswith("modeling_olmo2.py")   # the MLP's line
    src = render(step_util.lowered(olmo2().to(torch.bfloat16), prologue=False)).source
    assert "rms_gate_up_silu<__nv_bfloat16, float, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 64, false, 0, false>(" \
        in src and ", nullptr, 0.0f, " in src
    assert compile_cuda(src, "fusec_step.cu").resources["fusec_step"]["spill_store_bytes"] == 0


def test_post_norm_mlp_tiles_round_as_the_ops_they_replace_in_bf16():
    """bf16 OLMo-2, the fused op without its norm over 5 tiles against the two ``linear`` ops and
    the ``silu_mul`` it replaces (the simulator's semantics of the unfused step): bitwise equal.
    Against eager ``silu(gate_proj(x)) * up_proj(x)``: each linear rounds alike (fp32 dot, one
    rounding), and eager rounds silu(gate) to bf16 before the product where silu_mul (and the
    normed form, Llama's kernel) does not: at most one bf16 step apart."""
    import torch.nn.functional as F
    import step_util
    from fusec.instructions.rms_gate_up_silu import RmsGateUpSilu
    from fusec.ir import Op, TensorInfo
    from fusec.ir.env import Env
    from fusec.ir.semantics import run_op
    g = step_util.lowered(olmo2().to(torch.bfloat16), prologue=False).graph
    op = next(o for o in g.ops if o.kind == "rms_gate_up_silu")
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(64, generator=gen) * 4).to(torch.bfloat16)
    wg, wu = ((torch.randn(96, 64, generator=gen) / 8).to(torch.bfloat16) for _ in range(2))
    env = Env(g, [None] * len(g.inputs))
    for slot, v in (("x", x), ("wg", wg), ("wu", wu)):
        env.bufs[g.root(op.inputs[slot])] = v.reshape(g.tensors[g.root(op.inputs[slot])].shape)
    tiles = RmsGateUpSilu.tiles(op, g, 5)
    roots = {g.root(op.inputs[s]) for s in ("x", "wg", "wu")}
    assert len(tiles) == 5 and all({r.tensor for r in t.reads} == roots and len(t.reads) == 3 for t in tiles)
    for t in tiles:
        RmsGateUpSilu.run_tile(op, t, env)
    got = env.read(op.outputs["out"]).reshape(-1).clone()
    for name in ("ref_gate", "ref_up", "ref_out"):
        g.add_tensor(TensorInfo(name, (1, 96), torch.bfloat16))
    for o in (Op("rg", "linear", {"x": op.inputs["x"], "w": op.inputs["wg"]}, {"out": "ref_gate"}),
              Op("ru", "linear", {"x": op.inputs["x"], "w": op.inputs["wu"]}, {"out": "ref_up"}),
              Op("rs", "silu_mul", {"gate": "ref_gate", "up": "ref_up"}, {"out": "ref_out"})):
        run_op(o, env)
    assert torch.equal(got, env.read("ref_out").reshape(-1))
    eager = F.silu(F.linear(x, wg)) * F.linear(x, wu)
    assert torch.equal(env.read("ref_gate").reshape(-1), F.linear(x, wg))
    torch.testing.assert_close(got, eager, rtol=2 ** -7, atol=0)


def gpt_neox(vocab=128):
    """Tiny GPT-NeoX/Pythia (LayerNorm with bias, parallel residual, partial rotary), fp32."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=vocab, max_position_embeddings=256, rotary_pct=0.25,
                        use_parallel_residual=True, attn_implementation="sdpa")
    return GPTNeoXForCausalLM(cfg).eval().requires_grad_(False)


def stablelm(vocab=128):
    """Tiny StableLM (LayerNorm with bias, partial rotary, GQA), fp32."""
    from transformers import StableLmConfig, StableLmForCausalLM
    torch.manual_seed(0)
    cfg = StableLmConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256,
                         partial_rotary_factor=0.25, attn_implementation="sdpa")
    return StableLmForCausalLM(cfg).eval().requires_grad_(False)


@pytest.mark.parametrize("factory", [gpt_neox, stablelm])
def test_layernorm_families_match_eager(factory, steps):
    """native_layer_norm becomes the layernorm kind (it used to send the graph to inductor);
    the projections are matvecs over all SMs; the step matches eager."""
    _decode_against_eager(factory())
    (step,) = steps
    kinds = step.schedule.graph.count_kinds()
    assert kinds["layernorm"] >= 4 and "aten.native_layer_norm.default" not in kinds
    assert "linear" not in kinds and kinds["attention_partial"] == 2


def gemma(vocab=128, dtype=torch.float32):
    """Tiny Gemma ((1 + w) RMSNorm with non-trivial weights, GeGLU with gelu-tanh, embedding
    scale, pad_token_id), fp32 or bf16."""
    from transformers import GemmaConfig, GemmaForCausalLM
    torch.manual_seed(0)
    cfg = GemmaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=vocab, max_position_embeddings=256,
                      pad_token_id=0, attn_implementation="sdpa")
    m = GemmaForCausalLM(cfg).eval().requires_grad_(False)
    for layer in m.model.layers:
        layer.input_layernorm.weight.normal_(generator=torch.Generator().manual_seed(2))
        layer.post_attention_layernorm.weight.normal_(generator=torch.Generator().manual_seed(3))
    return m.to(dtype)


def test_gemma_fuses_norm_geglu_and_matches(steps):
    """Gemma: the (1 + w) weight folds to a constant, its RMSNorm (weight applied in fp32) and the
    GeGLU MLP ride in the fused kinds; only the embedding scale stays generic."""
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    _decode_against_eager(gemma())
    (step,) = steps
    kinds = step.schedule.graph.count_kinds()
    assert kinds["rms_qkv_rope"] == 2 and kinds["rms_gate_up_silu"] == 2 and kinds["rms_lm_head"] == 1
    assert {k for k in kinds if k.startswith("aten.")} <= {"aten.copy_.default", "aten.mul.Tensor"}
    gate_up = [o for o in step.schedule.graph.ops if o.kind == "rms_gate_up_silu"]
    assert all(o.attrs["act"] == "gelu_tanh" for o in gate_up)
    src = render(step.schedule).source
    kernel = compile_cuda(src, "fusec_step.cu")
    assert kernel.resources["fusec_step"]["spill_store_bytes"] == 0
    assert "warning" not in kernel.log, kernel.log   # the embed-scale multiply's scalar: no unused index


def test_gemma_bf16_as_close_to_fp32_as_bf16_eager(steps):
    """bf16 Gemma on the simulator: no further from the fp32 model than bf16 eager (x 1.5); its
    norms apply the weight in fp32 before rounding (w_fp32) inside the fused kinds."""
    from transformers import StaticCache
    ref, model = gemma(), gemma(dtype=torch.bfloat16)
    caches = [StaticCache(config=model.config, max_cache_len=32) for _ in range(3)]
    p = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(1))
    ref(input_ids=p, past_key_values=caches[0])
    for c in caches[1:]:
        model(input_ids=p, past_key_values=c)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"num_sms": 16})
    gen = torch.Generator().manual_seed(4)
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(4):
            t = torch.randint(0, 128, (1, 1), generator=gen)
            r = ref(input_ids=t, past_key_values=caches[0]).logits.double()
            e = model(input_ids=t, past_key_values=caches[1]).logits.double()
            a = compiled(input_ids=t, past_key_values=caches[2]).logits.double()
            assert (a - r).norm() / r.norm() <= 1.5 * (e - r).norm() / r.norm()
    torch._dynamo.reset()
    assert not w.fallbacks
    fused = [o for o in steps[0].schedule.graph.ops if o.kind.startswith("rms_")]
    # Gemma's norm (w = 1 + weight in fp32) in each: the kind's own, or a folded prologue's last
    # member (layer 0's input norm after the embedding scale, tests/test_prologue.py)
    assert len(fused) == 5 and all(o.attrs["pre"][-1].attrs["w_fp32"] if "pre" in o.attrs else o.attrs["w_fp32"]
                                   for o in fused)


def cohere(vocab=128):
    """Tiny Cohere (bias-free LayerNorm as mean/var ops, interleaved RoPE, parallel block,
    logit scale), fp32."""
    from transformers import CohereConfig, CohereForCausalLM
    torch.manual_seed(0)
    cfg = CohereConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    return CohereForCausalLM(cfg).eval().requires_grad_(False)


def olmo(vocab=128):
    """Tiny OLMo (non-parametric LayerNorm: no weight, no bias), fp32."""
    from transformers import OlmoConfig, OlmoForCausalLM
    torch.manual_seed(0)
    cfg = OlmoConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    return OlmoForCausalLM(cfg).eval().requires_grad_(False)


@pytest.mark.parametrize("factory", [cohere, olmo])
def test_generic_heavy_families_match_eager_and_emit_cuda(factory, steps):
    """Families whose norms or rotary have no fused kind still run as one schedule: their
    projections are matvecs over all SMs, the rest generated ops; the kernel compiles."""
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    _decode_against_eager(factory())
    (step,) = steps
    kinds = step.schedule.graph.count_kinds()
    assert "linear" not in kinds and kinds["attention_partial"] == 2
    kernel = compile_cuda(render(step.schedule).source, "fusec_step.cu")
    assert "warning" not in kernel.log, kernel.log   # e.g. a broadcast operand's unused coordinate
