"""argmax_rows: a step's argmax over the last dim of up to 16 rows, split across SMs (column
ranges, candidates per row, a last-ticket merge), on the CPU simulator against eager: a batch's
greedy tokens, ties across tiles (the first column wins), NaN (ranks highest), and the kernel
compiled with NVRTC."""
from __future__ import annotations

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch

VOCAB = 3000   # 5 column ranges of at least 512 (fusec.instructions.argmax_rows.MIN_COLS)


class _GreedyRows(torch.nn.Module):
    """A decode step of B sequences that returns each one's greedy token ``[B]``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, cache):
        return self.model(input_ids=tokens, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1)


def _model(seed: int):
    """A tiny Qwen3 (untied LM head) of VOCAB tokens."""
    return hf_tiny.qwen3(vocab=VOCAB, seed=seed)


def _steps_against_eager(model, batch: int, tokens: list[torch.Tensor], steps_rec,
                         prompt: torch.Tensor | None = None, device: str = "cpu") -> list:
    """Each of ``tokens`` ([batch, 1]) as one step through the compiled greedy step and eagerly,
    after a 3-token prefill (``prompt``, default random): equal tokens; the step's argmax is
    ``argmax_rows`` over several tiles. Returns the compiled step's outputs."""
    gen = torch.Generator().manual_seed(batch)
    caches = [hf_tiny.static_cache(model, 16) for _ in range(2)]
    with torch.no_grad():
        p = (torch.randint(0, VOCAB, (batch, 3), generator=gen) if prompt is None else prompt).to(device)
        for c in caches:
            model(input_ids=p, past_key_values=c, use_cache=True)
    torch._dynamo.reset()
    compiled = torch.compile(_GreedyRows(model), backend="fusec", options={"num_sms": 8})
    outs = []
    with FallbackWatch() as w, torch.no_grad():
        for t in tokens:
            t = t.to(device)
            a, b = compiled(t, caches[0]), _GreedyRows(model)(t, caches[1])
            assert torch.equal(a, b), (a, b)
            outs.append(a)
    torch._dynamo.reset()
    assert not w.fallbacks and w.compiled == 1, w.fallbacks
    step = steps_rec[-1]
    g = step.schedule.graph
    (am,) = [o for o in g.ops if o.kind == "argmax_rows"]
    assert "aten.argmax.default" not in g.count_kinds()
    assert am.attrs["rows"] == batch and sum(1 for i in step.schedule.instrs if i.op == am.name) == 5
    return outs


@pytest.mark.parametrize("factory,batch", [(hf_tiny.gpt2, 1), (hf_tiny.qwen3, 3)], ids=["gpt2-1", "qwen3-3"])
def test_greedy_tokens_of_a_batch_equal_eager(factory, batch, steps):
    """GPT-2 at B = 1 (a LayerNorm head: no ``rms_lm_head`` takes its argmax) and Qwen3 at B = 3:
    four steps of random tokens, each sequence's greedy token equal to eager's."""
    gen = torch.Generator().manual_seed(7)
    _steps_against_eager(factory(seed=1, vocab=VOCAB), batch,
                         [torch.randint(0, VOCAB, (batch, 1), generator=gen) for _ in range(4)], steps)


def test_ties_across_tiles_take_the_first_column_and_nan_ranks_highest(steps):
    """Rows 700 and 2900 of the LM head equal (their logits tie, in different tiles) and the
    largest: the first column wins; then rows 1200 and 2500 NaN: the first NaN column wins (two
    sequences of the same tokens: the same logits)."""
    model = _model(2)
    w = model.lm_head.weight
    tok = torch.tensor([[5], [5]])
    with torch.no_grad():
        w.mul_(0.01)
        w[700] = w[2900] = torch.linspace(-1, 1, w.shape[1])
        cache = hf_tiny.static_cache(model, 16)
        prompt = torch.randint(0, VOCAB, (1, 3), generator=torch.Generator().manual_seed(2)).expand(2, 3)
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        logit = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[0, -1, 700]
        w[700] *= 100 * torch.sign(logit)   # the tied rows' logits the largest
        w[2900] = w[700]
    (a,) = _steps_against_eager(model, 2, [tok], steps, prompt)
    assert a.tolist() == [700, 700]
    with torch.no_grad():
        w[1200] = w[2500] = float("nan")
    (a,) = _steps_against_eager(model, 2, [tok], steps, prompt)
    assert a.tolist() == [1200, 1200]


def test_kernel_compiles_with_nvrtc(steps, tmp_path):
    """The B = 3 step's kernel (bf16) has one ``argmax_rows`` call and compiles without spills."""
    from fusec.cuda.codegen import render
    from fusec.cuda.jit import compile_cuda
    model = _model(3).to(torch.bfloat16)
    tokens = [torch.tensor([[1], [2], [3]])]
    _steps_against_eager(model, 3, tokens, steps)
    src = render(steps[-1].schedule).source
    assert src.count("argmax_rows<__nv_bfloat16, 3, 3000, 5, 8>(") == 1, [
        ln for ln in src.splitlines() if "argmax_rows<" in ln]
    compile_cuda(src, "fusec_step.cu", cache_dir=str(tmp_path)).assert_no_spills()


@pytest.mark.gpu
def test_greedy_tokens_of_a_batch_equal_eager_on_the_gpu(steps):
    """The kernel: B = 3 sequences, four steps, each sequence's greedy token equal to eager's (the
    tiles' candidates and the last-ticket merge on the GPU; fp32: bf16 logits of two engines may
    round a near tie apart)."""
    gen = torch.Generator().manual_seed(8)
    model = hf_tiny.qwen3(seed=4, vocab=VOCAB).to("cuda")
    _steps_against_eager(model, 3, [torch.randint(0, VOCAB, (3, 1), generator=gen) for _ in range(4)], steps,
                         device="cuda")


@pytest.mark.parametrize("batch,kind", [(3, "argmax_rows"), (1, "rms_lm_head")])
def test_reference_executor_runs_the_fused_op_whole(batch, kind):
    """The reference executor (``fusec.ir.semantics.execute``, which runs a fused op as one tile:
    tests/test_fidelity.py runs it after every pass) writes the greedy tokens, of ``argmax_rows``
    (B = 3) and of ``rms_lm_head``'s argmax epilogue (B = 1): the merge counts the tickets of its
    own tiling (before: of the kernel's, so the one tile never merged)."""
    import step_util
    from fusec.ir import Role
    from fusec.ir.semantics import execute
    from fusec.passes import fold_position, fuse, normalize, recognize
    model = _model(1)
    cache = hf_tiny.static_cache(model, 24)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (batch, 5), generator=gen), past_key_values=cache, use_cache=True)
    aten_gm, g, flat = step_util.capture(_GreedyRows(model), {"tokens": torch.randint(0, VOCAB, (batch, 1), generator=gen),
                                                             "cache": cache})
    weights = {n: a for n, a in zip(g.inputs, flat) if g.tensors[n].role == Role.WEIGHT}
    with torch.no_grad():
        want = aten_gm(*[a.clone() for a in flat])
        g = fuse.run(fold_position.run(recognize.run(normalize.run(g), weights), weights), 8)
        assert kind in g.count_kinds() and "aten.argmax.default" not in g.count_kinds()
        got = execute(g, [a.clone() for a in flat])
    assert [t.tolist() for t in got] == [t.tolist() for t in want]


def test_a_reduction_longer_than_fp32_holds_exactly_stays_generic():
    """The candidates hold a column as an fp32 value (exact below 2**24): an argmax over 2**24
    columns or more is no ``argmax_rows`` (the rule's check)."""
    from fusec.instructions import argmax_rows
    from fusec.ir import Graph, Op, TensorInfo
    for cols, fused in ((argmax_rows.MAX_COLS - 1, True), (argmax_rows.MAX_COLS, False)):
        g = Graph()
        g.add_tensor(TensorInfo("x", (1, cols), torch.float32))
        g.add_tensor(TensorInfo("y", (1,), torch.int64))
        am = Op("am", "aten.argmax.default", {"in0": "x"}, {"out": "y"}, attrs={"args": (None, -1), "kwargs": {}})
        g.ops.append(am)
        assert argmax_rows._ok(g, {"x": "x", "_anchor": am}) is fused, cols
