"""Decode steps of a batch of sequences (B > 1, one new token each) through
torch.compile(backend="fusec") and HF generate(), on the CPU simulator: eager's logits and
tokens, one fusec step, no fallback (docs/batch.md)."""
from __future__ import annotations

import re

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch

#: prompt lengths of the sequences of a batch (left-padded to the longest)
LENGTHS = (5, 2, 7, 3, 6, 1, 4)


def _left_padded(model, batch: int, gen: torch.Generator,
                 lengths: tuple[int, ...] = LENGTHS) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of ``lengths[:batch]`` tokens (past their number the lengths again, in
    order), left-padded with token 0 to the longest, as a tokenizer with
    ``padding_side="left"`` makes them: (input_ids, attention_mask), [B, T]."""
    lens = [lengths[i % len(lengths)] for i in range(batch)]
    t = max(lens)
    ids = torch.randint(1, model.config.vocab_size, (batch, t), generator=gen)
    mask = torch.zeros(batch, t, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, t - n:] = 1
        ids[i, : t - n] = 0
    return ids, mask


def _mask4d(full: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``[B, L]`` 0/1 attention_mask as the 4-D mask ``[B, 1, 1, L]`` that SDPA reads: bool
    (True attends), or additive in ``dtype`` (0 attends, the dtype's lowest value masks, as
    HF's eager masks)."""
    keep = full.bool()[:, None, None, :]
    if dtype == torch.bool:
        return keep
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min).to(full.device)


def batch_steps_against_eager(model, batch: int, seed: int, n: int = 4, length: int = 24,
                              device: str = "cpu", options: dict | None = None,
                              mask_dtype: torch.dtype | None = None,
                              lengths: tuple[int, ...] = LENGTHS) -> tuple[list[float], object, list]:
    """A batch of ``batch`` left-padded random prompts (:data:`LENGTHS`), prefilled eagerly on two
    StaticCaches of ``length`` rows, then ``n`` decode steps with random tokens, the
    cache-length ``attention_mask`` and per-sequence ``position_ids`` (as generate() passes
    them) through ``torch.compile(model, backend="fusec")`` (default options, or ``options``)
    and eagerly: (per step the largest relative logits error over the sequences, each on its
    own, the FallbackWatch, the two caches). ``mask_dtype``: the decode steps pass the mask as
    the 4-D ``[B, 1, 1, L]`` mask SDPA reads (:func:`_mask4d`: bool, or additive float) instead
    of the ``[B, L]`` one HF turns into it. ``lengths``: the prompts' lengths (default
    :data:`LENGTHS`)."""
    gen = torch.Generator().manual_seed(seed)
    ids, mask = _left_padded(model, batch, gen, lengths)
    ids, mask = ids.to(device), mask.to(device)
    caches = [hf_tiny.static_cache(model, length) for _ in range(2)]
    with torch.no_grad():
        for c in caches:
            model(input_ids=ids, attention_mask=mask, past_key_values=c, use_cache=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", **({"options": options} if options else {}))
    errs = []
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(n):
            tok = torch.randint(1, model.config.vocab_size, (batch, 1), generator=gen).to(device)
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long, device=device)], 1)
            full = torch.zeros(batch, length, dtype=torch.long, device=device)
            full[:, : mask.shape[1]] = mask
            kw = dict(attention_mask=full if mask_dtype is None else _mask4d(full, mask_dtype),
                      position_ids=mask.sum(-1, keepdim=True) - 1, use_cache=True)
            a = compiled(input_ids=tok, past_key_values=caches[0], **kw).logits.double()
            b = model(input_ids=tok, past_key_values=caches[1], **kw).logits.double()
            assert a.shape == (batch, 1, model.config.vocab_size)
            # every sequence on its own: a wrong one hides in a batch norm
            errs.append(max(((a[i] - b[i]).norm() / b[i].norm()).item() for i in range(batch)))
    torch._dynamo.reset()
    return errs, w, caches


@pytest.mark.parametrize("batch", [2, 4])
@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_batch_decode_matches_eager(factory, batch, steps):
    """A batch of left-padded prompts of different lengths, prefilled eagerly, then 4 decode
    steps (:func:`batch_steps_against_eager`): the compiled step's logits and caches equal
    eager's, every call runs one fusec step (no fallback), its attention (the split-KV
    ``attention_partial`` over the batch's B·Hkv KV heads: tests/test_batch_attention.py) reads
    the per-sequence mask [B, 1, 1, L] without materializing the GQA expand of the cache."""
    model = factory()
    errs, w, caches = batch_steps_against_eager(model, batch, 10 * batch + (factory is hf_tiny.qwen3))
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert steps and not any(s.fallen_back for s in steps)
    assert sum(s.calls for s in steps) == 4
    for layer_a, layer_b in zip(caches[0].layers, caches[1].layers):
        assert torch.allclose(layer_a.keys, layer_b.keys, atol=1e-5)
        assert torch.allclose(layer_a.values, layer_b.values, atol=1e-5)
    for s in steps:
        g = s.schedule.graph
        assert g.batch() == batch
        att = [o for o in g.ops for o in ([o] if o.kind != "chain" else o.attrs["ops"])
               if o.kind.startswith("attention")]
        assert len(att) == model.config.num_hidden_layers and all(o.kind == "attention_partial" for o in att)
        assert all(o.attrs["mask_kind"] == 1 and g.tensors[o.inputs["mask"]].shape[0] == batch for o in att)
        # HF's mask, its causal part AND the padding, attends no row past the position: the
        # attention reads rows 0 .. pos only (fusec.ir.mask_proofs.bounded_by_positions)
        assert all(o.attrs.get("mask_bound") for o in att)
        assert "fusec.sdpa.default" not in g.count_kinds()
        # the B tokens' rows are gathered by the embedding kind, one tile per sequence
        emb = [o for o in g.ops if o.kind == "embedding"]
        assert len(emb) == 1 and "aten.embedding.default" not in g.count_kinds(), g.count_kinds()
        assert sum(1 for i in s.schedule.instrs if i.op == emb[0].name) == batch


@pytest.mark.parametrize("batch", [3, 16])
def test_a_batch_without_padding_reads_only_its_positions(batch, steps):
    """B prompts of one length and decode steps without an ``attention_mask`` (a plain loop over
    a batch that needs no padding): HF's mask [B, 1, 1, L] repeats the causal row of the shared
    position for every sequence, which recognize proves at every position, so the attention
    takes no mask (``mask_kind`` 0: it reads rows 0 .. pos, not all L with a mask per row, and the
    mask's position-table lookup leaves the step); logits equal eager's over steps at several
    positions, one fusec step, no fallback. A left-padded batch keeps its mask
    (:func:`test_batch_decode_matches_eager`)."""
    model = hf_tiny.llama()
    gen = torch.Generator().manual_seed(batch)
    length = 32
    ids = torch.randint(1, model.config.vocab_size, (batch, 5), generator=gen)
    caches = [hf_tiny.static_cache(model, length) for _ in range(2)]
    with torch.no_grad():
        for c in caches:
            model(input_ids=ids, past_key_values=c, use_cache=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec")
    errs = []
    with FallbackWatch() as w, torch.no_grad():
        for _ in range(4):
            tok = torch.randint(1, model.config.vocab_size, (batch, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0]).logits.double()
            b = model(input_ids=tok, past_key_values=caches[1]).logits.double()
            errs.append(max(((a[i] - b[i]).norm() / b[i].norm()).item() for i in range(batch)))
    torch._dynamo.reset()
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert steps and not any(s.fallen_back for s in steps) and sum(s.calls for s in steps) == 4
    for s in steps:
        g = s.schedule.graph
        att = [o for o in g.ops for o in ([o] if o.kind != "chain" else o.attrs["ops"])
               if o.kind.startswith("attention")]
        assert len(att) == model.config.num_hidden_layers
        assert all(o.kind == "attention_partial" and o.attrs["mask_kind"] == 0 and "mask" not in o.inputs
                   for o in att), [(o.kind, o.attrs.get("mask_kind")) for o in att]
        assert not any(g.tensors[t].dtype == torch.bool and g.tensors[t].shape[-1] == length
                       for o in g.ops for t in o.outputs.values()), "the mask is still computed"
    for layer_a, layer_b in zip(caches[0].layers, caches[1].layers):
        assert torch.allclose(layer_a.keys, layer_b.keys, atol=1e-5)


def test_a_batch_of_more_than_16_sequences_falls_back_with_a_line():
    """B = 17 sequences (more rows than the fused kinds take: every op would be generic on one
    SM) fall back with one line naming the batch, and the logits equal eager's."""
    model = hf_tiny.llama(layers=1)
    errs, w, _ = batch_steps_against_eager(model, 17, 17, n=1)
    assert max(errs) < 1e-6, errs
    assert w.compiled == 0 and len(w.fallbacks) == 1, (w.compiled, w.fallbacks)
    assert "(17 sequences, more than 16)" in w.fallbacks[0], w.fallbacks


@pytest.mark.parametrize("factory", [hf_tiny.gpt2, hf_tiny.gemma2, hf_tiny.falcon, hf_tiny.phi2, hf_tiny.olmo2])
def test_batch_decode_of_other_families_matches_eager(factory, steps):
    """Families whose layers differ from Llama's (LayerNorm rows and Conv1D: GPT-2; sliding and
    full layers, softcaps: Gemma-2; a parallel block: Falcon, Phi-2 with partial RoPE; q/k norms
    over the whole projection: OLMo-2) in a batch of 2: every sequence's logits equal eager's,
    one fusec step, no fallback."""
    errs, w, _ = batch_steps_against_eager(factory(), 2, 7, n=2)
    assert max(errs) < 1e-5, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert steps and all(s.schedule.graph.batch() == 2 and not s.fallen_back for s in steps)


def _assert_fused(g, batch: int, layers: int, head_norm: bool, seq_rope: bool = True) -> None:
    """Every layer's q/k/v (norm, projections, RoPE, KV writes) is one batched ``rms_qkv_rope`` and
    its gate/up (norm, projections, SiLU product) one batched ``rms_gate_up_silu``; no generic
    RoPE, KV write, SiLU product or linear is left. ``seq_rope``: the cos/sin are the step's rows,
    one per sequence (else the tables at the one position)."""
    kinds = g.count_kinds()
    assert kinds.get("rms_qkv_rope") == layers and kinds.get("rms_gate_up_silu") == layers, kinds
    assert not {"rope", "kv_write", "silu_mul", "linear"} & set(kinds), kinds
    for o in g.ops:
        if o.kind == "rms_qkv_rope":
            assert o.attrs["batch"] == batch and "qk_part" not in o.outputs   # whole heads per tile
            assert ("q_norm_w" in o.inputs) == head_norm
            assert ("rope_pos" not in o.inputs) == seq_rope
            if seq_rope:   # [B, .., D]: each sequence's own cos/sin row
                cos = g.tensors[o.inputs["cos_table"]]
                assert cos.shape[0] == batch and cos.numel == batch * o.attrs["head_dim"]
            assert g.tensors[g.root(o.outputs["kcache"])].shape[0] == batch
        if o.kind == "rms_gate_up_silu":
            assert o.attrs["batch"] == batch


def _compile_config(**kw):
    from transformers.generation import CompileConfig
    cc = CompileConfig(backend="fusec", **kw)
    cc._compile_all_devices = True   # HF compiles on CUDA only unless told (this machine has no GPU)
    return cc


@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_batch_generate_equals_eager(factory, steps):
    """generate() of 3 left-padded prompts (input_ids [3, T] and their attention_mask) with a
    static cache and a fusec CompileConfig: the greedy tokens equal eager generate()'s, and every
    decode call after the prefill ran one fusec step over the batch, with no fallback, each layer
    in the batched fused kinds."""
    model = factory()
    model.generation_config.pad_token_id = 0
    model.config.pad_token_id = 0
    ids, mask = _left_padded(model, 3, torch.Generator().manual_seed(4))
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, cache_implementation="static")
    ref = model.generate(ids, **kw)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        out = model.generate(ids, compile_config=_compile_config(), **kw)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert torch.equal(out, ref)
    (step,) = steps
    assert step.calls == 9 and not step.fallen_back
    assert step.schedule.graph.batch() == 3
    _assert_fused(step.schedule.graph, 3, model.config.num_hidden_layers, head_norm=factory is hf_tiny.qwen3)


def test_batch_kernel_compiles_with_nvrtc(steps):
    """The batch-2 decode step's megakernel (the batched linear, the split-KV attention over the
    batch's KV heads with each sequence's mask row) renders and compiles for sm_90a without
    register spills."""
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    model = hf_tiny.llama()
    model.generation_config.pad_token_id = 0
    ids, mask = _left_padded(model, 2, torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation="static",
                   compile_config=_compile_config())
    torch._dynamo.reset()
    (step,) = steps
    src = render(step.schedule).source
    # the attention over 2 * 2 KV heads, each GQA group of 2 query heads cut as the tile-heads rule
    # says (attention_rules.auto_q_groups: 2 tile groups of one head at the run-time length's
    # capacity, counted as 4096 rows), a tile group's mask row its sequence's (the run-time
    # length's slot: generate()'s step takes every cache length)
    (cut,) = {o.attrs.get("q_groups", 1) for o in step.schedule.graph.ops if o.kind == "attention_partial"}
    assert cut == 2
    assert re.search(rf"attention_partial_merge<float, float, float, 8, {4 * cut}, 16, [^;]*, smem, "
                     rf"\(\(\(const bool\*\)bufs\[A\[\d+\]\]\) \+ \(size_t\)\(in\.p0 / {2 * cut}\) \* FUSEC_LEN\(", src)
    assert "const int b_ = h / 4;" not in src   # no generic attention
    kernel = compile_cuda(src, "fusec_step.cu")
    assert kernel.resources["fusec_step"]["spill_store_bytes"] == 0


def test_generate_num_return_sequences_with_sampling(steps):
    """generate(do_sample=True, num_return_sequences=3) expands one prompt to a batch of 3: the
    sampled tokens equal eager generate()'s under the same seed (same logits, same draws), and
    the decode calls ran one fusec step of batch 3 with no fallback."""
    model = hf_tiny.llama(seed=2)
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(8))
    kw = dict(max_new_tokens=8, do_sample=True, top_k=5, num_return_sequences=3, cache_implementation="static")
    torch.manual_seed(0)
    ref = model.generate(ids, **kw)
    torch._dynamo.reset()
    with FallbackWatch() as w:
        torch.manual_seed(0)
        out = model.generate(ids, compile_config=_compile_config(), **kw)
    torch._dynamo.reset()
    assert not w.fallbacks, w.fallbacks
    assert out.shape == (3, 14) and torch.equal(out, ref)
    (step,) = steps
    assert step.schedule.graph.batch() == 3 and step.calls == 7 and not step.fallen_back
