"""What one tile of ``rms_qkv_rope`` computes, in torch (the simulator's reference for the
kernel's tiles; :mod:`fusec.instructions.rms_qkv_rope` gives the method and the layout): the
units' weight rows against the staged vector, bias, one rounding, the per-head or
whole-projection q/k RMSNorm, RoPE, and the stores of q and the KV-cache row; at R = B·K > 1
rows (B sequences of K query tokens) every row at once (:meth:`QkvRopeTiles._run_seqs`)."""
from __future__ import annotations

import functools

import torch

from fusec.abi import Fault
from fusec.ir import Op
from fusec.ir.env import Env
from fusec.ir.semantics import rms_normalize
from fusec.instructions.base import Tile
from fusec.instructions.matvec_rows import batched, normed, seqs, staged
from fusec.instructions.qkv_match import proj_norm, rotary_dim, seq_rope, tokens, w_stride


class QkvRopeTiles:
    """The tile semantics of :class:`fusec.instructions.rms_qkv_rope.RmsQkvRope` (a mixin: it
    uses the kind's ``_layout``, ``_spans``, ``_head``, ``_split`` and ticket methods)."""

    @classmethod
    def _step_inputs(cls, op: Op, env: Env) -> tuple:
        """What every tile of ``op`` reads alike in one step, computed by its first tile and kept
        in ``env.memo`` (an op's inputs do not change while its tiles run): (RoPE position, KV
        write position, the staged vector fp32 [H], the cos and sin rows fp32 [rd]). Raises the
        kernel's faults ROPE_POS and KV_POS (no access; the step is invalid)."""
        key = (op.name, "rms_qkv_rope")
        got = env.memo.get(key)
        if got is None:
            from fusec.ir.aten_exec import index_fault
            rp = int(env.read(op.inputs["rope_pos"]).reshape(-1)[0])
            kv_pos = int(env.read(op.inputs["kv_pos"]).reshape(-1)[0])
            rows, L = env.read(op.inputs["cos_table"]).shape[0], env.length(op.outputs["kcache"], 2)
            if not 0 <= rp < rows:
                raise index_fault(op, "RoPE position", rp, rows, Fault.ROPE_POS)
            if not 0 <= kv_pos < L:
                raise index_fault(op, "KV-cache write position", kv_pos, L, Fault.KV_POS)
            n = staged(op, env, normed(op))
            cos = env.read(op.inputs["cos_table"])[rp].reshape(-1).float()
            sin = env.read(op.inputs["sin_table"])[rp].reshape(-1).float()
            got = env.memo[key] = (rp, kv_pos, n, cos, sin)
        return got

    @classmethod
    def run_tile(cls, op: Op, tile: Tile, env: Env) -> None:
        if batched(op):
            return cls._run_seqs(op, tile, env)
        nq, nkv, d, _ = cls._layout(op, env.g)
        half = d // 2
        a = op.attrs
        dt = a["dtype"]
        _, kv_pos, n, cos, sin = cls._step_inputs(op, env)
        split = cls._split(op, tile)
        r = rotary_dim(op) // 2
        proj = proj_norm(op)
        ws = w_stride(op)
        for h, p0, p1 in cls._spans(op, env.g, *tile.params["units"]):
            w, out, row = cls._head(op, h, nq, nkv)
            wt = env.read(op.inputs[w])
            # units p0 .. p1: rows i1, i2 of the head; rotated where p < rd/2 (pair_rows). All
            # rotated (p1 <= rd/2: every unit of a full RoPE): rows p0 .. p1 and p0 + rd/2 ..
            # p1 + rd/2, read and written as slices (the same values as the index tensors')
            ps, rot, i1, i2 = _unit_rows(d, 2 * r, p0, p1)
            full = p1 <= r
            wr = row * ws   # the head's first row in its weight (a fused one's: heads ws apart)
            if full:
                y1, y2 = wt[wr + p0:wr + p1].float() @ n, wt[wr + r + p0:wr + r + p1].float() @ n
            else:
                y1, y2 = wt[wr + i1].float() @ n, wt[wr + i2].float() @ n
            if "bq" in op.inputs:
                b = env.read(op.inputs["b" + w[1]]).reshape(-1).float()
                y1, y2 = (y1 + b[wr + p0:wr + p1], y2 + b[wr + r + p0:wr + r + p1]) if full else \
                    (y1 + b[wr + i1], y2 + b[wr + i2])
            y1, y2 = y1.to(dt).float(), y2.to(dt).float()
            if proj and out != "vcache":   # pre-norm values; the last q/k tile does all heads
                part = env.flat(op.outputs["qk_part"])
                part[h * d + i1], part[h * d + i2] = y1, y2
                continue
            if split is not None:   # a piece of a q/k head: its pre-norm values; the last piece does the head
                part = env.flat(op.outputs["qk_part"])   # (a per-head norm: full RoPE, i1 = ps, i2 = ps + D/2)
                part[h * d + p0:h * d + p1] = y1
                part[h * d + half + p0:h * d + half + p1] = y2
                if not cls._is_last(op, tile, env, h):
                    continue
                y = part[h * d:(h + 1) * d].clone()
                y1, y2, p0, p1 = y[:half], y[half:], 0, half
                ps = torch.arange(p0, p1)
                rot, i1, i2 = ps < r, ps, ps + half
                full = False
            if out != "vcache":
                nw = op.inputs.get("q_norm_w" if out == "q" else "k_norm_w")
                if nw is not None:  # whole head (p0 = 0, p1 = half); Gemma-3's weight in fp32 (qk_w_fp32)
                    y = rms_normalize(torch.cat([y1, y2]).to(dt), env.read(nw), a["qk_eps"], dt,
                                      a.get("qk_w_fp32", False)).float()
                    y1, y2 = y[:half], y[half:]
                if full:   # every unit rotated: the same products on the pairs' slices
                    c1, c2, s1, s2 = cos[p0:p1], cos[r + p0:r + p1], sin[p0:p1], sin[r + p0:r + p1]
                    y1, y2 = y1 * c1 - y2 * s1, y2 * c2 + y1 * s2
                else:
                    pr = ps[rot]
                    c1, c2, s1, s2 = cos[pr], cos[pr + r], sin[pr], sin[pr + r]
                    a1, a2 = y1[rot], y2[rot]
                    y1, y2 = y1.clone(), y2.clone()
                    y1[rot], y2[rot] = a1 * c1 - a2 * s1, a2 * c2 + a1 * s2
            if out == "q":
                f = env.flat(op.outputs["q"])
                if full:
                    f[row * d + p0:row * d + p1] = y1.to(dt)
                    f[row * d + r + p0:row * d + r + p1] = y2.to(dt)
                else:
                    f[row * d + i1] = y1.to(dt)
                    f[row * d + i2] = y2.to(dt)
            else:
                cache = env.read(op.outputs[out])
                if full:
                    cache[0, row, kv_pos, p0:p1] = y1.to(cache.dtype)
                    cache[0, row, kv_pos, r + p0:r + p1] = y2.to(cache.dtype)
                else:
                    cache[0, row, kv_pos, i1] = y1.to(cache.dtype)
                    cache[0, row, kv_pos, i2] = y2.to(cache.dtype)
        if cls._takes_qk(op, tile) and cls._is_last_qk(op, tile, env):
            cls._finish_proj(op, env, cos, sin, kv_pos)

    @classmethod
    def _run_seqs(cls, op: Op, tile: Tile, env: Env) -> None:
        """A tile of an op of R = B·K > 1 rows (B sequences of K query tokens each, row s being
        sequence s // K's token s % K; docs/batch.md): the units' rows of W against each row's
        staged vector (``[R, H]``: its own RMSNorm, or a folded prologue's rows), the bias, one
        rounding; q/k heads: the per-head norm (whole heads), RoPE with each row's cos/sin (its
        own row of ``cos_table`` [R, rd], :func:`seq_rope`; else the tables' row ``rope_pos[k]``
        for token k: K = 1, the one shared position); q heads to ``q`` [B, Hq, K, D] at
        (sequence, head, token), k/v heads to the sequence's caches [B, Hkv, L, D] at row
        ``kv_pos[k]`` (shared by the sequences: HF's StaticCache ``cache_position``). Raises the
        kernel's faults KV_POS and ROPE_POS for a position out of range (no access)."""
        nq, nkv, d, _ = cls._layout(op, env.g)
        half, a, nrows, kt = d // 2, op.attrs, seqs(op), tokens(op)
        nseq = nrows // kt
        dt = a["dtype"]
        from fusec.ir.aten_exec import index_fault
        kv_pos = env.read(op.inputs["kv_pos"]).reshape(-1).to(torch.int64)
        L = env.length(op.outputs["kcache"], 2)
        for p in kv_pos.tolist():   # the kernel's fault KV_POS: no access, the step is invalid
            if not 0 <= p < L:
                raise index_fault(op, "KV-cache write position", p, L, Fault.KV_POS)
        r = rotary_dim(op) // 2
        if seq_rope(op):   # [R, rd]: each row's own
            cos = env.read(op.inputs["cos_table"]).reshape(nrows, -1).float()
            sin = env.read(op.inputs["sin_table"]).reshape(nrows, -1).float()
        else:   # the tables' row at token k's position, for every sequence
            rps, rows = env.read(op.inputs["rope_pos"]).reshape(-1).tolist(), env.read(op.inputs["cos_table"]).shape[0]
            for rp in rps:
                if not 0 <= rp < rows:
                    raise index_fault(op, "RoPE position", rp, rows, Fault.ROPE_POS)
            at = torch.tensor(rps, dtype=torch.int64).repeat(nseq)   # row s: rope_pos[s % K]
            cos = env.read(op.inputs["cos_table"])[at].reshape(nrows, -1).float()
            sin = env.read(op.inputs["sin_table"])[at].reshape(nrows, -1).float()
        n = staged(op, env, normed(op)).view(nrows, -1)   # [R, H]
        q = env.flat(op.outputs["q"]).view(nseq, nq, kt, d)
        seq = torch.arange(nseq)[:, None, None]
        for h, p0, p1 in cls._spans(op, env.g, *tile.params["units"]):
            w, out, row = cls._head(op, h, nq, nkv)
            wt = env.read(op.inputs[w])
            ps = torch.arange(p0, p1)   # units p0 .. p1: rows i1, i2 of the head (pair_rows)
            rot = ps < r
            i1, i2 = torch.where(rot, ps, ps + r), torch.where(rot, ps + r, ps + half)
            wr = row * w_stride(op)
            y1, y2 = n @ wt[wr + i1].float().T, n @ wt[wr + i2].float().T   # [R, units]
            if "bq" in op.inputs:
                b = env.read(op.inputs["b" + w[1]]).reshape(-1).float()
                y1, y2 = y1 + b[wr + i1], y2 + b[wr + i2]
            y1, y2 = y1.to(dt).float(), y2.to(dt).float()
            if out != "vcache":
                nw = op.inputs.get("q_norm_w" if out == "q" else "k_norm_w")
                if nw is not None:   # whole heads (p0 = 0, p1 = half): each row's head normed
                    y = rms_normalize(torch.cat([y1, y2], -1).to(dt), env.read(nw), a["qk_eps"], dt,
                                      a.get("qk_w_fp32", False)).float()
                    y1, y2 = y[:, :half], y[:, half:]
                pr = ps[rot]
                c1, c2, s1, s2 = cos[:, pr], cos[:, pr + r], sin[:, pr], sin[:, pr + r]
                a1, a2 = y1[:, rot], y2[:, rot]
                y1, y2 = y1.clone(), y2.clone()
                y1[:, rot], y2[:, rot] = a1 * c1 - a2 * s1, a2 * c2 + a1 * s2
            y1, y2 = y1.view(nseq, kt, -1), y2.view(nseq, kt, -1)
            if out == "q":
                qh = q[:, row]   # [B, K, D]
                qh[..., i1], qh[..., i2] = y1.to(dt), y2.to(dt)
            else:
                cache = env.read(op.outputs[out])[:, row]   # [B, L, D]: token k at row kv_pos[k]
                cache[seq, kv_pos[None, :, None], i1] = y1.to(cache.dtype)
                cache[seq, kv_pos[None, :, None], i2] = y2.to(cache.dtype)

    @classmethod
    def _finish_proj(cls, op: Op, env: Env, cos: torch.Tensor, sin: torch.Tensor, kv_pos: int) -> None:
        """The last q/k tile, a norm over the whole projection: all of q (then all of k) from
        ``qk_part``, RMSNorm over its Hq*D (Hkv*D) values (HF ``Olmo2RMSNorm``: fp32, the weight
        in fp32 before one rounding with ``qk_w_fp32``), RoPE of each head in fp32 and one
        rounding; q to ``q``, k to the caches' row ``kv_pos``."""
        nq, nkv, d, _ = cls._layout(op, env.g)
        a, half = op.attrs, d // 2
        dt = a["dtype"]
        part = env.flat(op.outputs["qk_part"])
        for out, h0, n, nw in (("q", 0, nq, "q_norm_w"), ("kcache", nq, nkv, "k_norm_w")):
            y = rms_normalize(part[h0 * d:(h0 + n) * d].to(dt), env.read(op.inputs[nw]).reshape(-1), a["qk_eps"],
                              dt, a.get("qk_w_fp32", False)).float().view(n, d)
            y1, y2 = y[:, :half], y[:, half:]
            r = torch.cat([y1 * cos[:half] - y2 * sin[:half], y2 * cos[half:] + y1 * sin[half:]], -1)
            if out == "q":
                env.flat(op.outputs["q"])[:] = r.reshape(-1).to(dt)
            else:
                cache = env.read(op.outputs["kcache"])
                cache[0, :, kv_pos, :] = r.to(cache.dtype)


@functools.lru_cache(maxsize=4096)
def _unit_rows(d: int, rd: int, p0: int, p1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(units p0 .. p1, whether each is a rotation pair, its first row, its second row) in a head
    of ``d`` rows with ``rd`` rotated (:func:`pair_rows`); kept per shape (the simulator asks the
    same for every step): read only, never written."""
    r, half = rd // 2, d // 2
    ps = torch.arange(p0, p1)
    rot = ps < r
    return ps, rot, torch.where(rot, ps, ps + r), torch.where(rot, ps + r, ps + half)
