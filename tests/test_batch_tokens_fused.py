"""Steps of K > 1 query tokens per sequence through the fused Llama kinds (docs/batch.md, "Several
query tokens (K > 1)"; issue 32): a step of B sequences of K tokens is R = B·K activation rows,
and it lowers as a batch of R one-token sequences does: each layer's RMSNorm + q/k/v + RoPE + the
K-row KV-cache writes one ``rms_qkv_rope`` (attributes ``batch`` R, ``tokens`` K; template
``rms_qkv_rope_seqs`` with ``KT`` K; HF's ``[B, K, H, D] -> [B, H, K, D]`` transposes of q, k and
v absorbed) and its RMSNorm + gate/up + SiLU product one ``rms_gate_up_silu`` (``batch`` R).
Checked on the CPU simulator through ``torch.compile(model, backend="fusec", options={"query_tokens":
K})`` against eager: every row's logits, the K cache rows each step writes (and the rest of the
caches untouched), no fallback, the fused kinds in the schedule; each tile's writes inside the
regions it declares; the families the matcher refuses at K > 1 stay as before and still match eager."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import hf_tiny
from fusec.fallbacks import FallbackWatch

_spec = importlib.util.spec_from_file_location("layer_ops", Path(__file__).resolve().parent.parent / "tools" / "layer_ops.py")
layer_ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layer_ops)

#: cache rows of the tests
LENGTH = 40


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def k_step_against_eager(model, batch: int, k: int, seed: int, position_ids: bool = True, device: str = "cpu"):
    """Random prompts prefilled eagerly on two StaticCaches of :data:`LENGTH` rows (B > 1:
    left-padded prompts of 6, 3, ... tokens and their mask, as a tokenizer with
    ``padding_side="left"`` and HF generate() make them), then one step of ``k`` random tokens per
    sequence through ``torch.compile(model, backend="fusec", options={"query_tokens": k})`` and
    eagerly: at B > 1 with the cache-length ``attention_mask`` [B, L] and, with ``position_ids``,
    HF generate()'s positions [B, K] (each sequence's real tokens so far + k; without them HF
    derives one position per token from the cache position, shared by the sequences). The
    inputs are drawn on the CPU and moved to ``device`` (the model's).

    Returns (the largest relative logits error of any (sequence, token) row, the largest
    relative error of the K cache rows the step wrote (every layer, k and v), whether every other
    cache row is as eager left it, the FallbackWatch)."""
    from test_batch_decode import _left_padded
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    if batch > 1:
        ids, mask = _left_padded(model, batch, gen, lengths=(6, 3, 5, 2))
    else:
        ids, mask = torch.randint(1, vocab, (1, 5), generator=gen), None
    t0 = ids.shape[1]
    ids, mask = ids.to(device), mask.to(device) if mask is not None else None
    caches = [hf_tiny.static_cache(model, LENGTH) for _ in range(2)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"query_tokens": k})
    with FallbackWatch() as w, torch.no_grad():
        for c in caches:
            model(input_ids=ids, attention_mask=mask, past_key_values=c, use_cache=True)
        kw = {}
        if batch > 1:
            full = torch.zeros(batch, LENGTH, dtype=torch.long, device=device)
            full[:, :t0] = mask
            full[:, t0:t0 + k] = 1
            kw["attention_mask"] = full
            if position_ids:
                kw["position_ids"] = mask.sum(-1, keepdim=True) + torch.arange(k, device=device)
        tok = torch.randint(1, vocab, (batch, k), generator=gen).to(device)
        a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True, **kw).logits
        b = model(input_ids=tok, past_key_values=caches[1], use_cache=True, **kw).logits
    torch._dynamo.reset()
    assert a.shape == b.shape == (batch, k, vocab)
    err = max(_rel(a[s, i], b[s, i]) for s in range(batch) for i in range(k))
    rows_err, rest_equal = 0.0, True
    for la, lb in zip(caches[0].layers, caches[1].layers):
        for x, y in ((la.keys, lb.keys), (la.values, lb.values)):
            rows_err = max(rows_err, _rel(x[:, :, t0:t0 + k], y[:, :, t0:t0 + k]))
            rest_equal &= torch.equal(x[:, :, :t0], y[:, :, :t0]) and torch.equal(x[:, :, t0 + k:], y[:, :, t0 + k:])
    return err, rows_err, rest_equal, w


def assert_fused_k(step, model, batch: int, k: int, head_norm: bool = False, seq_rope: bool = True) -> None:
    """The K-token step's layers are the fused kinds of its B·K rows: per layer one
    ``rms_qkv_rope`` (``batch`` B·K, ``tokens`` K, q [B, Hq, K, D] as the rope made it, the caches
    [B, Hkv, L, D] written at ``kv_pos`` [K]; ``head_norm``: Qwen3's per-head q/k norms, whole heads
    per tile; ``seq_rope``: the cos/sin the step's own rows [B·K, rd], else the K rows every
    sequence shares at ``rope_pos`` 0 .. K - 1) and one ``rms_gate_up_silu`` (``batch`` B·K); no
    generic RoPE, KV write, SiLU product, RMSNorm or linear, and no q/k/v ``permute`` left; what is
    left of one tile in layer 0 (tools/layer_ops.py) is the positions' ``table_lookup``s."""
    g = step.schedule.graph
    cfg = model.config
    layers, rows = cfg.num_hidden_layers, batch * k
    assert (g.batch(), g.query_tokens()) == (batch, k)
    ops = [o for o in g.ops for o in ([o] if o.kind != "chain" else o.attrs["ops"])]
    kinds = {}
    for o in ops:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    assert kinds.get("rms_qkv_rope") == layers and kinds.get("rms_gate_up_silu") == layers, kinds
    assert not {"rope", "kv_write", "silu_mul", "rmsnorm", "linear"} & set(kinds), kinds
    # B > 1: the rotary embedding's transpose of its positions' product, once in front of the layers
    assert not [o.source for o in ops if o.kind == "aten.permute.default" and o.layer is not None]
    hq = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    rd = int(d * getattr(cfg, "partial_rotary_factor", 1.0))
    for o in ops:
        if o.kind == "rms_qkv_rope":
            assert o.attrs["batch"] == rows and o.attrs["tokens"] == k, o.attrs
            assert "qk_part" not in o.outputs and ("q_norm_w" in o.inputs) == head_norm
            assert tuple(g.tensors[o.outputs["q"]].shape) == (batch, hq, k, d)
            assert g.tensors[g.root(o.outputs["kcache"])].shape[0] == batch
            assert g.tensors[o.inputs["kv_pos"]].numel == k
            cos = g.tensors[o.inputs["cos_table"]]
            if seq_rope:
                assert "rope_pos" not in o.inputs and tuple(cos.shape) == (rows, rd)
            else:
                assert tuple(cos.shape) == (k, rd)
                pos = g.tensors[o.inputs["rope_pos"]]
                assert pos.value is not None and pos.value.tolist() == list(range(k))
        if o.kind == "rms_gate_up_silu":
            assert o.attrs["batch"] == rows and "tokens" not in o.attrs
    tiles: dict[str, int] = {}
    for ins in step.schedule.instrs:
        tiles[ins.op] = tiles.get(ins.op, 0) + 1
    assert all(tiles[o.name] > 1 for o in g.ops if o.kind in ("rms_qkv_rope", "rms_gate_up_silu"))
    one = [(kind, what) for kind, n, what in layer_ops.layer_rows(step.schedule, 0) if n == 1]
    assert one and set(one) == {("table_lookup", "")}, one   # the last layer's: the counters' copy_ too


@pytest.fixture
def region_check(monkeypatch):
    """Wraps ``rms_qkv_rope``'s simulator tile: every element a tile changes in q and the KV caches
    lies inside the writes its run-time regions declare (what the simulator's hazard check
    orders). Returns {op name: {root tensor: set of elements declared written}} over the tiles
    run (their union per op, to compare with what the op must write)."""
    from fusec.instructions.rms_qkv_rope import RmsQkvRope
    orig = RmsQkvRope.run_tile
    declared: dict[str, dict[str, set]] = {}

    def run_tile(op, tile, env):
        roots = {env.g.root(op.outputs[s]) for s in ("q", "kcache", "vcache")}
        before = {r: env.flat(r).clone() for r in roots}
        _, writes = RmsQkvRope.runtime_regions(op, tile, env)
        orig(op, tile, env)
        mine = declared.setdefault(op.name, {})
        for r in roots:
            allowed = set()
            for w in writes:
                if env.g.root(w.tensor) == r:
                    allowed |= set(range(w.start, w.stop))
            mine.setdefault(r, set()).update(allowed)
            after = env.flat(r)
            diff = (after != before[r]) & ~(after.isnan() & before[r].isnan())   # a fresh buffer holds NaNs
            changed = set(diff.nonzero().reshape(-1).tolist())
            assert changed <= allowed, (op.name, tile.index, r, sorted(changed - allowed)[:8])
    run_tile.keeps_cache = True   # checks only: the lowered step is the same
    monkeypatch.setattr(RmsQkvRope, "run_tile", run_tile)
    return declared


def _assert_declared_cover(step, declared: dict, batch: int, k: int, t0: int) -> None:
    """The union of an ``rms_qkv_rope`` op's declared writes is all of q and exactly the K cache
    rows ``t0 .. t0 + K`` of every sequence and KV head (each as large as a head)."""
    g = step.schedule.graph
    for o in g.ops:
        if o.kind != "rms_qkv_rope":
            continue
        got = declared[o.name]
        assert got[g.root(o.outputs["q"])] == set(range(g.tensors[o.outputs["q"]].numel))
        b, hkv, L, d = g.tensors[g.root(o.outputs["kcache"])].shape
        want = {((s * hkv + h) * L + p) * d + t for s in range(b) for h in range(hkv)
                for p in range(t0, t0 + k) for t in range(d)}
        for c in ("kcache", "vcache"):
            assert got[g.root(o.outputs[c])] == want, c


@pytest.mark.parametrize("k", [2, 4])
def test_k_token_step_is_the_fused_kinds(k, steps, region_check):
    """Tiny Llama, one sequence (a 5-token prompt), a step of K = 2 or 4 tokens: every row's
    logits and the K cache rows equal eager's (< 1e-5, fp32), the other rows untouched, no
    fallback; the layers are the fused kinds of K rows with the cos/sin the position tables' K
    rows at the step's counter (:func:`assert_fused_k`); each tile writes inside its declared
    regions, which cover q and the K cache rows."""
    model = hf_tiny.llama(layers=2, seed=k)
    err, rows_err, rest, w = k_step_against_eager(model, 1, k, 40 + k)
    assert err < 1e-5 and rows_err < 1e-5 and rest, (err, rows_err, rest)
    assert not w.fallbacks and w.compiled == 1, (w.fallbacks, w.compiled)
    assert len(steps) == 1 and not steps[0].fallen_back
    assert_fused_k(steps[0], model, 1, k)
    _assert_declared_cover(steps[0], region_check, 1, k, 5)


def test_batch_of_k_token_steps_is_the_fused_kinds(steps, region_check):
    """Tiny Llama, B = 2 left-padded prompts (6 and 3 tokens) with their ``attention_mask`` and
    HF generate()'s ``position_ids`` [2, 4] (each sequence at its own positions), a step of K = 4
    tokens each (8 rows): every row's logits and the K cache rows of both sequences equal eager's,
    no fallback; the fused kinds of 8 rows with the cos/sin the step's own [8, D] rows."""
    model = hf_tiny.llama(layers=2, seed=7)
    err, rows_err, rest, w = k_step_against_eager(model, 2, 4, 71)
    assert err < 1e-5 and rows_err < 1e-5 and rest, (err, rows_err, rest)
    assert not w.fallbacks and w.compiled == 1, (w.fallbacks, w.compiled)
    assert_fused_k(steps[0], model, 2, 4)
    _assert_declared_cover(steps[0], region_check, 2, 4, 6)


def test_batch_of_k_token_steps_at_shared_positions(steps):
    """B = 3 sequences, K = 2, called with the mask but without ``position_ids``: HF derives one
    position per token from the cache position, shared by the sequences ([1, K] cos/sin rows), so
    the op reads those K rows as a table at ``rope_pos`` 0 .. K - 1 (template without
    ``SEQROPE``); eager's logits and cache rows, no fallback."""
    model = hf_tiny.llama(layers=2, seed=8)
    err, rows_err, rest, w = k_step_against_eager(model, 3, 2, 83, position_ids=False)
    assert err < 1e-5 and rows_err < 1e-5 and rest, (err, rows_err, rest)
    assert not w.fallbacks and w.compiled == 1, (w.fallbacks, w.compiled)
    assert_fused_k(steps[0], model, 3, 2, seq_rope=False)


@pytest.mark.parametrize("batch,k", [(1, 4), (2, 2)])
def test_k_token_steps_with_qkv_biases(batch, k, steps):
    """Qwen2's q/k/v biases (non-zero), K = 4 at B = 1 and K = 2 at B = 2 (left-padded, per
    sequence positions): eager's logits and cache rows, no fallback, the fused kinds with the
    biases as their inputs."""
    model = hf_tiny.qwen2_bias(seed=batch)
    err, rows_err, rest, w = k_step_against_eager(model, batch, k, 90 + batch)
    assert err < 1e-5 and rows_err < 1e-5 and rest, (err, rows_err, rest)
    assert not w.fallbacks and w.compiled == 1, (w.fallbacks, w.compiled)
    assert_fused_k(steps[0], model, batch, k)
    assert all({"bq", "bk", "bv"} <= set(o.inputs) for o in steps[0].schedule.graph.ops if o.kind == "rms_qkv_rope")


@pytest.mark.parametrize("batch,k", [(1, 4), (2, 4)])
def test_k_token_steps_with_per_head_norms(batch, k, steps, region_check):
    """Qwen3's per-head q/k RMSNorms (before HF's transpose), K = 4 at B = 1 and at B = 2: whole
    heads per tile (no ``qk_part``), each of the B·K rows' heads normed on its own; eager's
    logits and cache rows, no fallback; each tile writes inside its declared regions."""
    model = hf_tiny.qwen3(layers=2, seed=batch)
    err, rows_err, rest, w = k_step_against_eager(model, batch, k, 95 + batch)
    assert err < 1e-5 and rows_err < 1e-5 and rest, (err, rows_err, rest)
    assert not w.fallbacks and w.compiled == 1, (w.fallbacks, w.compiled)
    assert_fused_k(steps[0], model, batch, k, head_norm=True)
    _assert_declared_cover(steps[0], region_check, batch, k, 5 if batch == 1 else 6)


@pytest.mark.parametrize("factory", [hf_tiny.olmo2, hf_tiny.gpt_neox])
def test_k_token_refusals_leave_the_layer_as_before(factory, steps):
    """What ``match_qkv`` refuses at K > 1 stays batched matvecs and the generic RoPE and KV
    writes, and still equals eager (K = 4): OLMo-2's q/k norms over the whole projection (one
    row only), GPT-NeoX's q/k/v as interleaved pieces of one fused product (at K = 1 the kind reads
    views of its weight; at K > 1 HF transposes the fused product before cutting it)."""
    err, rows_err, rest, w = k_step_against_eager(factory(), 1, 4, 61)
    assert err < 1e-5 and rows_err < 1e-5 and rest, (err, rows_err, rest)
    assert not w.fallbacks and w.compiled == 1, (w.fallbacks, w.compiled)
    kinds = steps[0].schedule.graph.count_kinds()
    assert "rms_qkv_rope" not in kinds and kinds.get("rope") and kinds.get("kv_write"), kinds


def test_fused_rows_are_the_steps_rows():
    """``fused_batch`` (the fused kinds' rules) takes x of the step's R = B·K rows, R <= 16, all
    staged at once: 8 rows of a step of 2 sequences x 4 tokens; not x of another number of rows,
    nor rows that do not fit ``STAGE_BYTES`` together (the subgraph then stays batched matvecs)."""
    from fusec.instructions.matvec_rows import STAGE_BYTES, fused_batch
    from fusec.ir import Graph, Op
    g = Graph()
    q = g.new_tensor("q", (2, 4, 4, 16), torch.float32)
    g.ops.append(Op("att", "attention", {"q": q}, {"out": g.new_tensor("o", (2, 4, 4, 16), torch.float32)}))
    g.record_rows()
    assert g.rows() == 8
    x = g.new_tensor("x", (2, 4, 64), torch.float32)
    assert fused_batch(g, x, 64, 4) == 8
    assert fused_batch(g, g.new_tensor("x4", (4, 64), torch.float32), 64, 4) == 0   # 4 rows of an 8-row step
    wide = STAGE_BYTES // 4 // 8 + 4   # 8 rows of it overflow the staging budget
    assert fused_batch(g, g.new_tensor("xw", (8, wide), torch.float32), wide, 4) == 0
    fits = STAGE_BYTES // 4 // 8
    assert fused_batch(g, g.new_tensor("xf", (8, fits), torch.float32), fits, 4) == 8


def test_k_token_call_matches_the_template():
    """At K > 1 ``rms_qkv_rope_seqs`` takes ``KT`` as its last template argument, after WS:
    every template argument before it is written out (BIAS and TB too, which are passed only
    where a later one differs from its default), one per template parameter, in order; at K = 1
    (a batch of one-token sequences) KT is left out (its default 1) and the call is as before."""
    from test_kind_rules import _template_params
    from fusec.instructions import KINDS
    from fusec.instructions.call import Call
    from fusec.ir import Op
    call: Call = KINDS["rms_qkv_rope"].call
    params = _template_params("rms_qkv_rope_seqs", "rms_qkv_rope_seqs")
    assert params[-1].replace(" ", "") == "intKT=1", params
    for attrs, want in (({"batch": 8, "tokens": 4}, len(params)), ({"batch": 4}, params.index("bool BIAS = false"))):
        probe = Op("o", "rms_qkv_rope", {}, {}, attrs={**attrs, "head_dim": 16})
        used = [a for a in call.targs if a.when is None or a.when(probe)]
        values = {a.name: a.default if a.default is not None else "v" for a in used}
        if "tokens" in attrs:
            values["KT"] = 4
        text = call._list(probe, call.targs, values)
        assert len(text.split(", ")) == want, (attrs, text)
        if "tokens" in attrs:
            assert [a.name for a in used][-3:] == ["qkw32", "WS", "KT"] and text.endswith(", 4")
