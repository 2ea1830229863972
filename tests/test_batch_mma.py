"""The tensor-core path of the batched matvec (``matvec_seqs`` with ``MMA``, docs/batch.md "Speed"):
a batch step's bf16 / fp16 linears multiply 16 weight rows (the MMA's A) with the staged inputs
of up to 8 sequences (its B) by ``mma.sync`` m16n8k16 with fp32 accumulators, K split over the
CTA's warps; fp32 linears keep the CUDA-core FMAs.

No GPU runs here: the lanes' loads and the PTX ISA's fragment layout are emulated in numpy
(:func:`mma_16816`, :func:`emulate_group`, index for index what ``templates/matvec_seqs.cu.j2``
does) and compared with ``W @ x``; the template is compiled with NVRTC at Llama-3.2-1B's widths
without spills; the simulator's numerics are the batched matvec's of before (the simulator
computes its own fp32 product: ``matvec_rows.rows_dot``)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import hf_tiny
from test_batch_matvec import width_graph
from fusec.instructions import KINDS

TEMPLATE = Path(__file__).resolve().parent.parent / "templates" / "matvec_seqs.cu.j2"
#: warps of a CTA (fusec.instructions.base.CTA_THREADS / 32) and k steps of 32 loaded together
#: (FUSEC_LOADS_IN_FLIGHT / 2)
NW, J = 16, 4


def mma_16816(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """One ``mma.sync.aligned.m16n8k16.row.col.f32`` of a warp from its lanes' registers, laid
    out as the PTX ISA's "Matrix Fragments for mma.m16n8k16 with floating point type" states:
    ``a`` [32, 8] (lane, element a0..a7: two per .b32 register, the low half first), ``b`` [32, 4]
    (b0..b3), ``c`` [32, 4] (c0..c3); returns D = A B + C as the lanes' [32, 4]. Every element of
    A and B is asserted to come from exactly one lane."""
    A, B = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    for lane in range(32):
        g, t = lane >> 2, lane % 4
        for i in range(8):
            row = g if (i < 2 or 4 <= i < 6) else g + 8
            col = t * 2 + (i & 1) + (8 if i >= 4 else 0)
            assert np.isnan(A[row, col])
            A[row, col] = a[lane, i]
        for i in range(4):
            row, col = t * 2 + (i & 1) + (8 if i >= 2 else 0), g
            assert np.isnan(B[row, col])
            B[row, col] = b[lane, i]
    assert not np.isnan(A).any() and not np.isnan(B).any()
    D = A @ B
    out = c.copy()
    for lane in range(32):
        g, t = lane >> 2, lane % 4
        for i in range(4):
            out[lane, i] += D[g + 8 * (i >> 1), t * 2 + (i & 1)]
    return out


def mma_rows(w: np.ndarray, xs: np.ndarray, rows: int, k0: int, k1: int, k: int, s: int, acc: np.ndarray) -> None:
    """``mma_rows<T, K, S>`` of one warp: the 32-wide k steps [k0, k1) of the 16-row block ``w``
    (rows past ``rows`` read as zero) against ``xs`` [S, K]; ``acc`` [NT, 32, 4] (n-tile, lane,
    d index) accumulates: :func:`mma_rows2` with lane (g, t)'s rows g and g + 8 of the block
    (the template writes mma_rows out on its own, the same loads and MMAs)."""
    assert xs.shape == (s, k)
    w = np.concatenate([w, np.zeros((max(0, 16 - len(w)), w.shape[1]))])[:16]
    g = np.arange(8)
    mma_rows2(w[:8], w[8:16], g < rows, g + 8 < rows, xs, k0, k1, J, acc)


def mma_rows2(w0: np.ndarray, w1: np.ndarray, va: np.ndarray, vb: np.ndarray, xs: np.ndarray,
              k0: int, k1: int, J: int, acc: np.ndarray) -> None:
    """``mma_rows2<T, K, S, JS>`` of one warp: lane (g, t)'s A row g is ``w0[g]`` (valid where
    ``va[g]``), its A row g + 8 ``w1[g]`` (``vb[g]``), against ``xs`` [S, K]; k steps [k0, k1),
    J at a time; ``acc`` [NT, 32, 4] accumulates."""
    s, k = xs.shape
    nt = (s + 7) // 8
    zero = np.zeros(8)
    for st in range(k0, k1, J):
        ra, rb = np.zeros((J, 32, 8)), np.zeros((J, 32, 8))
        for j in range(J):
            kk = (st + j) * 32
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                inn = st + j < k1 and (k % 32 == 0 or kk + 8 * t < k)
                ra[j, lane] = w0[g, kk + 8 * t:kk + 8 * t + 8] if inn and va[g] else zero
                rb[j, lane] = w1[g, kk + 8 * t:kk + 8 * t + 8] if inn and vb[g] else zero
        for j in range(J):
            if st + j >= k1:
                continue
            kk = (st + j) * 32
            for n in range(nt):
                xb = np.zeros((32, 8))
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    inn = k % 32 == 0 or kk + 8 * t < k
                    if inn and 8 * n + g < s:
                        xb[lane] = xs[8 * n + g, kk + 8 * t:kk + 8 * t + 8]
                for h in (0, 1):   # Mma16816<T>::run(acc[n], ra.x, rb.x, ra.y, rb.y, xb.x, xb.y), then .z .w
                    a = np.concatenate([ra[j][:, 4 * h:4 * h + 2], rb[j][:, 4 * h:4 * h + 2],
                                        ra[j][:, 4 * h + 2:4 * h + 4], rb[j][:, 4 * h + 2:4 * h + 4]], axis=1)
                    acc[n] = mma_16816(a, xb[:, 4 * h:4 * h + 4], acc[n])


def emulate_group(w: np.ndarray, x: np.ndarray, r0: int, r1: int) -> tuple[np.ndarray, int, int]:
    """``seqs_group_mma`` for one staged group of S = len(x) inputs, without an epilogue: out
    [S, N] (NaN where the tile writes nothing; each output asserted written once) for the
    tile's rows [r0, r1), every warp's fragments as the template computes them; the partial
    sums of the KS > 1 path go through an array of the template's indices. Returns (out, KS,
    the floats of that array the tile used)."""
    s, k = x.shape
    nt, nks = (s + 7) // 8, (k + 31) // 32
    frag, threads = nt * 128, NW * 32
    per = (NW // 2 * frag + threads - 1) // threads
    out = np.full((s, w.shape[0]), np.nan)

    def write(r, sq, d):
        assert np.isnan(out[sq, r]), (r, sq)
        out[sq, r] = d

    nb = (r1 - r0 + 15) >> 4
    ks = 1 if nb == 0 or 2 * nb > NW else NW // nb
    if ks == 1:
        for warp in range(NW):
            for blk in range(warp, nb, NW):
                rb = r0 + 16 * blk
                acc = np.zeros((nt, 32, 4))
                mma_rows(w[rb:rb + 16], x, r1 - rb, 0, nks, k, s, acc)
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    for n in range(nt):
                        for i in range(4):
                            r, sq = rb + g + 8 * (i >> 1), 8 * n + 2 * t + (i & 1)
                            if r < r1 and sq < s:
                                write(r, sq, acc[n, lane, i])
        return out, ks, 0
    red = np.full(NW * frag, np.nan)
    for warp in range(NW):
        blk, part = warp // ks, warp % ks
        if blk < nb:
            acc = np.zeros((nt, 32, 4))
            rb = r0 + 16 * blk
            mma_rows(w[rb:rb + 16], x, r1 - rb, part * nks // ks, (part + 1) * nks // ks, k, s, acc)
            for lane in range(32):
                for n in range(nt):
                    for i in range(4):
                        red[warp * frag + (4 * n + i) * 32 + lane] = acc[n, lane, i]
    for tid in range(threads):
        for i in range(per):
            p = tid + i * threads
            q, l = p % frag, p % frag & 31
            c = (q >> 5) & 3
            r = r0 + 16 * (p // frag) + (l >> 2) + 8 * (c >> 1)
            sq = 8 * (q >> 7) + 2 * (l & 3) + (c & 1)
            if p < nb * frag and r < r1 and sq < s:
                parts = [red[(p // frag * ks + kk) * frag + q] for kk in range(ks)]
                assert not np.isnan(parts).any()
                write(r, sq, sum(parts))
    return out, ks, nb * ks * frag


#: (K, S, r0, r1): one 16-row block split over 16 warps (Llama-3.2-1B's q/o/down tiles, 15-16
#: rows), a block of 4 rows (k/v: 3-4 rows), 4 blocks of 4 warps (gate/up: 62-63 rows), 3 blocks
#: of 5 warps, 13 blocks of one warp each and 61 blocks (the lm_head's 972 rows: 4 rounds of the
#: 16 warps); K a multiple of 32 or not (40: a step past the last whole one); S from 2 to 16
#: (two n-tiles past 8: the A fragment shared)
CASES = [(96, 8, 16, 32), (64, 2, 3, 18), (256, 16, 5, 20), (40, 5, 0, 4), (64, 11, 7, 69),
         (96, 3, 0, 40), (64, 16, 2, 210), (32, 8, 0, 972), (72, 13, 9, 58)]


@pytest.mark.parametrize("k,s,r0,r1", CASES)
def test_mma_emulation_equals_w_at_x(k, s, r0, r1):
    """The lanes' loads, the MMA fragments (PTX ISA layout) and the K-split partial sums of the
    template, emulated: every output of the tile's rows, each written once, equals ``W @ x``
    exactly (small integers: every sum is exact in fp32 whatever its order), whether a block is
    one warp's (KS 1) or shared by several (KS > 1; partial sums within the reserved shared
    memory, ``matvec_rows.mma_smem``)."""
    rng = np.random.default_rng(k * 1000 + s * 10 + r1)
    w = rng.integers(-3, 4, (r1 + 5, k)).astype(np.float64)
    x = rng.integers(-3, 4, (s, k)).astype(np.float64)
    out, ks, used = emulate_group(w, x, r0, r1)
    ref = x @ w.T
    assert np.array_equal(out[:, r0:r1], ref[:, r0:r1])
    assert np.isnan(out[:, :r0]).all() and np.isnan(out[:, r1:]).all()
    nb = -(-(r1 - r0) // 16)
    assert ks == (1 if 2 * nb > NW else NW // nb)
    assert used <= NW * 128 * ((s + 7) // 8)


def test_mma_fragment_permutation_is_the_same_for_w_and_x():
    """On paper, checked: within a 32-wide k step lane (g, t) holds elements 8t + 4h + [0, 4) of
    row g and row g + 8 for MMA h, so A's logical k 2t + e is element 8t + 4h + e and k 2t + 8 +
    e element 8t + 4h + 2 + e, the same for every row; the B fragment (b0, b1 = the input's same
    elements of sequence g) uses the same map, so each MMA sums W[r, e] x[s, e] over 16 distinct
    elements and the two MMAs cover the 32. Checked with one-hot inputs through
    :func:`mma_16816`."""
    seen = set()
    for h in (0, 1):
        for e in range(32):
            w = np.zeros((16, 32))
            w[:, e] = np.arange(1, 17)
            x = np.zeros((8, 32))
            x[:, e] = np.arange(1, 9) * 100
            acc = np.zeros((1, 32, 4))
            mma_rows(w, x, 16, 0, 1, 32, 8, acc)
            d = np.zeros((16, 8))
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for i in range(4):
                    d[g + 8 * (i >> 1), 2 * t + (i & 1)] = acc[0, lane, i]
            assert np.array_equal(d, np.outer(np.arange(1, 17), np.arange(1, 9) * 100))
            seen.add(e)
    assert seen == set(range(32))


def test_emulation_follows_the_template():
    """The emulation above is the template's code: the register order of the two MMAs of a k step,
    the lanes' chunk offsets, the partial-sum indices and the warps per block are these lines of
    ``templates/matvec_seqs.cu.j2`` (change both together)."""
    text = TEMPLATE.read_text()
    for line in ("Mma16816<T>::run(acc[n], ra[j].x, rb[j].x, ra[j].y, rb[j].y, xb.x, xb.y);",
                 "Mma16816<T>::run(acc[n], ra[j].z, rb[j].z, ra[j].w, rb[j].w, xb.z, xb.w);",
                 "const T* wa = w + (size_t)g * K + 8 * t;", "const T* wb = wa + (size_t)8 * K;",
                 "const T* xa = xs + g * K + 8 * t;", "*reinterpret_cast<const uint4*>(xa + n * 8 * K + k)",
                 "const int ks = nb == 0 || 2 * nb > NW ? 1 : NW / nb;",
                 "red[warp * FRAG + (4 * n + i) * 32 + lane] = acc[n][i];",
                 "d += red[(p / FRAG * ks + k) * FRAG + q];",
                 "const int r = r0 + 16 * (p / FRAG) + (l >> 2) + 8 * (c >> 1), "
                 "s = 8 * (q >> 7) + 2 * (l & 3) + (c & 1);",
                 "const int r = rb + g + 8 * (i >> 1), s = 8 * n + 2 * t + (i & 1);",
                 "(part + 1) * NKS / ks", "constexpr int NT = (S + 7) / 8, J = FUSEC_LOADS_IN_FLIGHT / 2"):
        assert line in text, line
    from fusec.cuda.knobs import KNOBS
    assert KNOBS["FUSEC_LOADS_IN_FLIGHT"] // 2 == J
    from fusec.instructions.base import CTA_THREADS
    assert CTA_THREADS // 32 == NW


#: Llama-3.2-1B's linears as batched ops: (name, K, N, kind): q (k and v: 512 rows), down with the
#: residual, up (gate alike), the lm_head
WIDTHS = (("q", 2048, 2048, "matvec"), ("k", 2048, 512, "matvec"), ("down", 8192, 2048, "matvec_residual"),
          ("up", 2048, 8192, "matvec"), ("head", 2048, 128256, "matvec"))


def _lowered(batch: int, dtype: torch.dtype):
    from fusec.config import Options
    from fusec.pipeline import Dumper, lower
    g, flat = width_graph(batch, dtype, WIDTHS)
    return lower(g, flat, Options.from_dict({"num_sms": 132}), Dumper(None))


def mma_flags(src: str) -> list[str]:
    """The ``MMA`` template argument of every ``matvec_seqs`` call of a rendered kernel (its 12th:
    TX, TW, TB, TR, TO, K, N, B, SG, BIAS, RES, MMA)."""
    return [m.group(1).split(", ")[11] for m in re.finditer(r"\bmatvec_seqs<([^()]*)>\(", src)]


def _mma_functions(src: str) -> dict[str, str]:
    """NVRTC's PTX of each ``matvec_seqs`` instantiation of a rendered kernel, by mangled name."""
    import importlib.util
    from fusec.cuda.jit import compile_ptx
    spec = importlib.util.spec_from_file_location("kernel_ptx", TEMPLATE.parent.parent / "tools" / "kernel_ptx.py")
    kp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kp)
    return {n: body for n, body in kp.functions(compile_ptx(src, "fusec_step.cu")).items() if "matvec_seqs" in n}


#: the batches and dtypes compiled at Llama-3.2-1B's widths: bf16 at B = 2 .. 16 (11 and 16: the
#: down projection's inputs read from L2, one and two n-tiles), fp16 at two
MMA_COMPILES = [(b, torch.bfloat16) for b in (2, 4, 8, 11, 16)] + [(8, torch.float16), (16, torch.float16)]


@pytest.mark.parametrize("batch,dtype", MMA_COMPILES)
def test_mma_path_compiles_without_spills_at_llama_1b_widths(batch, dtype, tmp_path):
    """Llama-3.2-1B's linears (2048 -> 2048, 2048 -> 512, 8192 -> 2048 with the residual, 2048 ->
    8192, 2048 -> 128256) as batched ops of B sequences in bf16 (fp16): every ``matvec_seqs``
    call takes the tensor-core path (``MMA`` true), its PTX holds the dtype's ``mma.sync``
    m16n8k16 with fp32 accumulators, and the kernel compiles with NVRTC for sm_90a without
    spills or a stack frame in any function; each op's shared memory holds its staged inputs
    and the partial sums (:func:`fusec.instructions.matvec_rows.mma_smem`) within the CTA's, or
    only the partial sums where B inputs do not fit at once (the down projection at B > 8: read
    from L2 with the weights, :func:`fusec.instructions.matvec_rows.global_x`, SG 0)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import MAX_SMEM_BYTES, render
    from fusec.instructions.matvec_rows import global_x, mma_smem, seq_group
    sched = _lowered(batch, dtype)
    g = sched.graph
    for o in g.ops:
        if o.kind in ("matvec", "matvec_residual"):
            k = g.tensors[o.inputs["w"]].shape[1]
            floats = KINDS[o.kind].smem_floats(o, g)
            if seq_group(batch, k, 2) < batch:   # read from L2, not staged (global_x): the partial sums
                assert global_x(o, g) and floats == mma_smem(o, g) == 128 * 16 * -(-batch // 8)
            else:
                assert not global_x(o, g) and floats == max(-(-batch * k * 2 // 4), mma_smem(o, g))
            assert 4 * floats <= MAX_SMEM_BYTES
    src = render(sched).source
    assert mma_flags(src) == ["true"] * len(WIDTHS)
    ptype = "bf16" if dtype == torch.bfloat16 else "f16"
    fns = _mma_functions(src)
    assert len(fns) == len(WIDTHS)
    for name, body in fns.items():
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptype}.{ptype}.f32" in body, name
    from fusec.cuda.jit import compile_cuda
    kernel = compile_cuda(src, "fusec_step.cu", options=("-Xptxas", "-v"), cache_dir=str(tmp_path))
    assert "warning" not in kernel.log, kernel.log
    lines = kernel.log.splitlines()
    props = [lines[i + 1] for i, l in enumerate(lines) if "Function properties for _Z11matvec_seqs" in l]
    assert len(props) == len(WIDTHS), kernel.log
    assert all("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in p for p in props), props
    kernel.assert_no_spills()


def test_fp32_batch_keeps_the_cuda_core_path():
    """fp32 weights keep the CUDA-core FMAs of ``row_dot_seqs`` (no TF32: fp32 numerics): every
    call passes ``MMA`` false and no ``matvec_seqs`` instantiation holds an ``mma``."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.codegen import render
    src = render(_lowered(16, torch.float32)).source
    assert mma_flags(src) == ["false"] * len(WIDTHS)
    fns = _mma_functions(src)
    assert len(fns) == len(WIDTHS) and not any("mma.sync" in body for body in fns.values())


def test_mma_follows_the_op_dtypes():
    """:func:`fusec.instructions.matvec_rows.mma`: the tensor-core path where the weight and the
    staged input share bf16 or fp16; fp32, or mixed dtypes, keep the CUDA-core path; a batch-1
    op passes no ``MMA`` at all (its call is the one before batches)."""
    from fusec.ir import Graph, Op, Role, TensorInfo
    from fusec.instructions.matvec_rows import MMA, mma
    cases = {(torch.bfloat16, torch.bfloat16): True, (torch.float16, torch.float16): True,
             (torch.float32, torch.float32): False, (torch.float32, torch.bfloat16): False,
             (torch.bfloat16, torch.float32): False, (torch.float16, torch.bfloat16): False}
    for (tw, tx), want in cases.items():
        g = Graph()
        g.add_tensor(TensorInfo("x", (4, 64), tx, Role.INPUT, input_index=0))
        g.add_tensor(TensorInfo("w", (32, 64), tw, Role.WEIGHT, input_index=1))
        op = Op("o", "matvec", {"x": "x", "w": "w"}, {"out": "y"}, attrs={"batch": 4})
        assert mma(op, g) == want, (tw, tx)
        assert MMA.value(op, g, None) == ("true" if want else "false")
    assert MMA.when(Op("o", "matvec", {}, {})) is False


@pytest.mark.parametrize("factory", [hf_tiny.llama, hf_tiny.qwen3])
def test_bf16_batch_step_takes_the_mma_path(factory, steps, tmp_path):
    """A bf16 batch of 4 left-padded prompts through ``torch.compile(backend="fusec")`` with
    default options: the simulated steps match eager per sequence as before (the simulator's
    own fp32 product; bf16 rounding bound), no fallback, every batched matvec op (o, down,
    lm_head) takes the tensor-core path (``MMA`` true: the final norm folded in as a ``STAGED``
    prologue too), and the batch kernel compiles with NVRTC without spills."""
    from test_batch_decode import batch_steps_against_eager
    from fusec.cuda.codegen import render
    model = factory().to(torch.bfloat16)
    errs, w, _ = batch_steps_against_eager(model, 4, 41, n=3)
    assert max(errs) < 3e-2, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    assert steps and not any(s.fallen_back for s in steps)
    g = steps[-1].schedule.graph
    # the o and down projections of each layer and the lm_head (q/k/v and gate/up are the
    # batched fused kinds, rms_qkv_rope and rms_gate_up_silu: tests/test_batch_fused.py)
    batched = [o for o in g.ops if o.kind in ("matvec", "matvec_residual")]
    assert len(batched) == 2 * model.config.num_hidden_layers + 1
    assert any(o.attrs.get("pre") for o in batched)   # a folded norm (STAGED): the lm_head's
    src = render(steps[-1].schedule).source
    flags = mma_flags(src)
    assert flags and set(flags) == {"true"}
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.jit import compile_cuda
    kernel = compile_cuda(src, "fusec_step.cu", cache_dir=str(tmp_path))
    seqs = {f: r for f, r in kernel.resources.items() if "matvec_seqs" in f}
    assert seqs and all(r["stack_frame_bytes"] == r["spill_store_bytes"] == r["spill_load_bytes"] == 0
                        for r in seqs.values()), seqs


@pytest.mark.parametrize("factory", [hf_tiny.phi2, hf_tiny.falcon])
def test_bf16_bias_and_gelu_epilogues_on_the_mma_path(factory, steps, tmp_path):
    """Phi-2 and Falcon in bf16 at B = 2: the batched up projection with its bias and GELU
    epilogue (``act``; Phi-2's linears carry biases) on the tensor-core path (``MMA`` true, ACT
    passed after it), eager's logits per sequence within bf16 rounding, no fallback, and the
    kernel's ``matvec_seqs`` functions compile without spills or a stack frame."""
    from test_batch_decode import batch_steps_against_eager
    from fusec.cuda.codegen import render
    errs, w, _ = batch_steps_against_eager(factory().to(torch.bfloat16), 2, 19, n=2)
    assert max(errs) < 3e-2, errs
    assert not w.fallbacks and w.compiled, w.fallbacks
    src = render(steps[-1].schedule).source
    assert set(mma_flags(src)) == {"true"}
    act = 3 if factory is hf_tiny.phi2 else 2
    assert re.search(rf"matvec_seqs<[^()]*, 2, 2, (true|false), false, true, {act}(, (true|false))?>\(", src)
    if factory is hf_tiny.phi2:
        assert re.search(r"matvec_seqs<[^()]*, 2, 2, true, false, true[,>]", src)   # a bias on the MMA path
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusec.cuda.jit import compile_cuda
    res = compile_cuda(src, "fusec_step.cu", cache_dir=str(tmp_path)).resources
    seqs = {f: r for f, r in res.items() if "matvec_seqs" in f}
    assert len(seqs) >= 2
    assert all(r["stack_frame_bytes"] == r["spill_store_bytes"] == r["spill_load_bytes"] == 0 for r in seqs.values())
