"""The fused batched kinds' pairs of rows on the tensor cores (``mma_pairs`` of
templates/seqs_rows.cu.j2: ``rms_gate_up_silu_seqs``'s gate/up rows, ``rms_qkv_rope_seqs``'s
rotation pairs), emulated in numpy as tests/test_batch_mma.py emulates ``mma_rows``: the lanes'
16-byte loads (``mma_rows2``, templates/matvec_seqs.cu.j2), the PTX ISA's m16n8k16 fragment layout
(:func:`test_batch_mma.mma_16816`), the 8 units of a block as A rows 0-7 (their first rows) and
8-15 (their second), the K-split partial sums in ``red`` and their reduction. Every (unit, row)
must get exactly one ``epi`` call with the two exact dot products; a wrong fragment mapping
fails (:func:`test_a_wrong_mapping_is_caught`). No GPU: CPU only."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from test_batch_mma import mma_16816, mma_rows2

TEMPLATE = Path(__file__).resolve().parent.parent / "templates" / "seqs_rows.cu.j2"
#: warps of a CTA (fusec.instructions.base.CTA_THREADS / 32); FUSEC_LOADS_IN_FLIGHT / 2
NW, LOADS_HALF = 16, 4


def emulate_pairs(u: int, rows0: np.ndarray, rows1: np.ndarray, xs: np.ndarray, wrong: str = ""):
    """``mma_pairs<TW, K, S>(U, xs, rp, epi, red)`` of a CTA of NW warps, rp(i, c) row i of
    ``rows0`` / ``rows1``: returns (the epi calls {(i, s): (sum0, sum1)}, each asserted once; KS;
    the floats of ``red`` used, which has exactly the shared memory ``matvec_rows.pair_smem``
    reserves: an index past it raises). ``wrong``: a deliberately wrong mapping (tests)."""
    s, k = xs.shape
    nt, nks = (s + 7) // 8, (k + 31) // 32
    frag = nt * 128
    J = 2 if nt > 1 else LOADS_HALF   # PAIR_STEPS: 2 past 8 rows, else mma_rows2's default
    nb = (u + 7) >> 3
    ks = 1 if nb == 0 or 2 * nb > NW else NW // nb
    out: dict = {}

    def epi(i, sq, a, b):
        assert (i, sq) not in out, (i, sq)
        out[(i, sq)] = (a, b)

    def block(blk, k0, k1):
        w0, w1, v = np.zeros((8, k)), np.zeros((8, k)), np.zeros(8, bool)
        for g in range(8):
            i = 8 * blk + g
            v[g] = i < u
            iu = i if v[g] else 8 * blk   # a unit that exists (not read)
            w0[g], w1[g] = rows0[iu], rows1[iu]
        acc = np.zeros((nt, 32, 4))
        mma_rows2(w0, w1, v, v, xs, k0, k1, J, acc)
        return acc

    def sums(acc_lane, n, c):   # (sum0, sum1) of lane's fragment: A row g (first), g + 8 (second)
        if wrong == "rows_swapped":
            return acc_lane[n, 2 + c], acc_lane[n, c]
        return acc_lane[n, c], acc_lane[n, 2 + c]

    def seq(n, t, c):
        return 8 * n + (t + 4 * c if wrong == "seq_index" else 2 * t + c)

    if ks == 1:
        for warp in range(NW):
            for blk in range(warp, nb, NW):
                acc = block(blk, 0, nks)
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    i = 8 * blk + g
                    for n in range(nt):
                        for c in (0, 1):
                            sq = seq(n, t, c)
                            if i < u and sq < s:
                                epi(i, sq, *sums(acc[:, lane], n, c))
        return out, ks, 0
    red = np.full(NW * 128 * nt, np.nan)   # pair_smem floats
    for warp in range(NW):
        blk, part = warp // ks, warp % ks
        if blk < nb:
            acc = block(blk, part * nks // ks, (part + 1) * nks // ks)
            for n in range(nt):
                for e in range(4):
                    red[warp * frag + (4 * n + e) * 32:warp * frag + (4 * n + e + 1) * 32] = acc[n, :, e]
    used = 0
    for p in range(nb * nt * 64):   # any thread: each p once
        l, c, n, b = p & 31, (p >> 5) & 1, (p >> 6) % nt, p // (nt * 64)
        i, sq = 8 * b + (l >> 2), seq(n, l & 3, c)
        if i < u and sq < s:
            s0 = s1 = 0.0
            for kk in range(ks):   # the K slices in order
                base = ((kk * nb + b) if wrong == "red_index" else (b * ks + kk)) * frag + l
                f0, f1 = red[base + (4 * n + c) * 32], red[base + (4 * n + 2 + c) * 32]
                if wrong == "rows_swapped":
                    f0, f1 = f1, f0
                assert not np.isnan(f0) and not np.isnan(f1), (p, kk)
                used = max(used, base + (4 * n + 2 + c) * 32 + 1)
                s0, s1 = s0 + f0, s1 + f1
            epi(i, sq, s0, s1)
    return out, ks, used


def _check(u: int, s: int, k: int, wrong: str = "") -> tuple[bool, int]:
    rng = np.random.default_rng(u * 1000 + s * 37 + k)
    rows0 = rng.integers(-3, 4, (u, k)).astype(np.float64)
    rows1 = rng.integers(-3, 4, (u, k)).astype(np.float64)
    xs = rng.integers(-3, 4, (s, k)).astype(np.float64)
    out, ks, used = emulate_pairs(u, rows0, rows1, xs, wrong)
    assert used <= NW * 128 * ((s + 7) // 8)
    ref0, ref1 = rows0 @ xs.T, rows1 @ xs.T   # [U, S]
    ok = set(out) == {(i, sq) for i in range(u) for sq in range(s)} and all(
        out[(i, sq)] == (ref0[i, sq], ref1[i, sq]) for i in range(u) for sq in range(s))
    return ok, ks


#: (U, S, K): U a multiple of 8 or not, from one block split over 16 warps (KS 16, more warps than
#: k steps at K = 40: empty slices) to 25 blocks over 16 warps (KS 1, two rounds); KS 2 (8 blocks:
#: a HEADNORM head of D = 128, gate/up tiles of 57-64 rows), 4, 5 (3 blocks); S from 2 to 16
#: (one or two n-tiles, not multiples of 8); K a multiple of 32 or not (40, 72: a step's last
#: lanes past K)
CASES = [(3, 2, 64), (8, 8, 96), (13, 5, 40), (24, 11, 64), (32, 16, 72), (64, 9, 96), (61, 3, 72),
         (200, 16, 40), (131, 7, 64), (17, 13, 104), (1, 16, 32)]


@pytest.mark.parametrize("u,s,k", CASES)
def test_mma_pairs_emulation_equals_the_dots(u, s, k):
    """Every (unit i < U, row s < S) gets one ``epi(i, s, rows0[i] . xs[s], rows1[i] . xs[s])``
    (exact: small integers), none for a unit past U or a row past S, with ``red`` inside the
    shared memory ``pair_smem`` reserves; the warps per block as the template's."""
    ok, ks = _check(u, s, k)
    assert ok
    nb = -(-u // 8)
    assert ks == (1 if 2 * nb > NW else NW // nb)


@pytest.mark.parametrize("wrong,u,s,k", [("rows_swapped", 5, 4, 64), ("seq_index", 8, 9, 64),
                                         ("rows_swapped", 200, 16, 96), ("seq_index", 40, 16, 40), ("red_index", 24, 6, 96),
                                         ("seq_index", 200, 3, 32)])
def test_a_wrong_mapping_is_caught(wrong, u, s, k):
    """The emulation's check fails for a wrong reading of the fragments (a unit's two rows
    swapped, row s = 8n + t + 4c instead of 8n + 2t + c) or of the partial sums (slice k of block
    b at warp k NB + b instead of b KS + k): it would catch a template that did so."""
    assert not _check(u, s, k, wrong)[0]


def test_emulation_follows_the_template():
    """The emulation above is these lines of ``mma_pairs`` (change both together), and the
    partial sums fit ``pair_smem``: NW warps of one warp's fragments (128 floats per 8 rows)."""
    text = TEMPLATE.read_text()
    for line in ("constexpr int NT = (S + 7) / 8, NW = FUSEC_THREADS / 32, NKS = (K + 31) / 32, FRAG = NT * 128;",
                 "constexpr int PAIR_STEPS = NT > 1 ? 2 : 0;",
                 "const int ks = nb == 0 || 2 * nb > NW ? 1 : NW / nb;",
                 "mma_rows2<TW, K, S, PAIR_STEPS>(rp(v ? i : 8 * blk, 0), rp(v ? i : 8 * blk, 1), v, v, xs, k0, k1, lane, acc);",
                 "const bool v = block(blk, 0, NKS, acc);",
                 "const int s = 8 * n + 2 * t + c;",
                 "if (v && s < S) epi(8 * blk + g, s, acc[n][c], acc[n][2 + c]);",
                 "block(blk, part * NKS / ks, (part + 1) * NKS / ks, acc);",
                 "red[warp * FRAG + (4 * n + e) * 32 + lane] = acc[n][e];",
                 "const int l = p & 31, c = (p >> 5) & 1, n = (p >> 6) % NT, b = p / (NT * 64);",
                 "const int i = 8 * b + (l >> 2), s = 8 * n + 2 * (l & 3) + c;",
                 "const float* f = red + (b * ks + k) * FRAG + l;",
                 "s0 += f[(4 * n + c) * 32];", "s1 += f[(4 * n + 2 + c) * 32];"):
        assert line in text, line
    mv = (TEMPLATE.parent / "matvec_seqs.cu.j2").read_text()
    for line in ("const T* wa = w0 + 8 * t;", "const T* wb = w1 + 8 * t;", "const T* xa = xs + g * K + 8 * t;",
                 "J = JS > 0 ? JS : (FUSEC_LOADS_IN_FLIGHT / 2 > 0 ? FUSEC_LOADS_IN_FLIGHT / 2 : 1);"):
        assert line in mv, line
    from fusec.cuda.knobs import KNOBS
    from fusec.instructions.base import CTA_THREADS
    from fusec.instructions.matvec_rows import pair_smem
    from fusec.ir import Op
    assert KNOBS["FUSEC_LOADS_IN_FLIGHT"] // 2 == LOADS_HALF and CTA_THREADS // 32 == NW
    for b in (2, 8, 9, 16):
        assert pair_smem(Op("o", "rms_gate_up_silu", {}, {}, attrs={"batch": b})) == NW * 128 * -(-b // 8)
