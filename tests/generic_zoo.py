"""An "op zoo" for the generic-op CUDA generator (fusec/cuda/gen): one module whose captured
graph holds nearly every ATen op fusec accepts (elementwise with broadcasting and scalars,
casts, creation, reductions, softmax, topk, mm/addmm/bmm, views, cat/split/pad/repeat, advanced
indexing and scatters, SDPA with masks, an in-place copy_ into an input), on small odd shapes.
Used by tests/test_generic_cuda.py (host C++ and NVRTC) and tests/test_gpu_generic.py (GPU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Zoo(torch.nn.Module):
    """forward(x, y [2,3,8], w [8,5], ids [1,4], iv int64 [3,4], bm bool [2,3,8], buf [4,8] mutated)."""

    def forward(self, x, y, w, ids, iv, bm, buf):
        r = []
        r += [torch.add(x, y, alpha=0.5), x - 2 * y, x * 3, x / (y.abs() + 1),
              torch.div(x, 0.7, rounding_mode="floor"),
              torch.div(iv, 3, rounding_mode="floor"), torch.div(iv, -3, rounding_mode="trunc"), -x, x.exp(),
              (y.abs() + 0.1).rsqrt(), y.abs().sqrt(), x ** 2, x ** 3, y.abs() ** 0.5, (y.abs() + 1) ** -1,
              y.abs() ** 2.5,
              y.abs() ** x, 2.0 ** x, iv ** 2, x.sigmoid(), F.silu(x), x.tanh(), x.cos(), x.sin(),
              torch.where(x > y, x, y), torch.where(bm, x, 0.0), x > 0.3, x <= y, iv == 2, iv != ids[0, 0],
              ~bm, bm & (x > 0), bm | (x > 0), bm ^ (x > 0), torch.logical_and(bm, x > 0),
              torch.logical_or(bm, x < 0),
              iv & 5, iv | 8, iv ^ 3, ~iv, x.to(torch.bfloat16), x.to(torch.int64), iv.float(), bm.float(),
              torch.full((3, 2), 1.5), torch.full_like(x, 7), torch.zeros_like(iv), torch.ones_like(x),
              torch.arange(2, 11, 3), torch.arange(0.5, 3.0, 0.25), x.abs(), torch.maximum(x, y), torch.minimum(x, y),
              x.clamp(-0.5, 0.5), x.clamp(min=y), x.clamp_min(0.1), x.clamp_max(-0.1), (y.abs() + 1).reciprocal(),
              torch.erf(x), F.gelu(x), F.gelu(x, approximate="tanh"), (y.abs() + 0.5).log(), x.expm1(),
              y.abs().log1p(), torch.remainder(x, 0.3), torch.remainder(iv, -3), torch.fmod(x, 0.3), torch.fmod(iv - 5, 3),
              torch.fmod(iv, -4), torch.floor_divide(iv, 4),
              torch.sign(x), torch.sign(iv), F.relu(x), F.relu(iv), F.relu(x) ** 2, F.leaky_relu(x),
              F.leaky_relu(x, 0.2)]
        # reductions
        r += [x.mean(-1), x.mean((0, 2), keepdim=True), x.sum(), iv.sum(1), bm.sum(), x.amax(1), x.amin((0, 1)),
              bm.any(-1), bm.any(), x.max(1).values, x.max(1).indices, x.min(-1)[0], x.min(-1)[1], x.argmax(),
              x.argmax(-1, keepdim=True), x.argmin(0), torch.var_mean(x, -1)[0],
              torch.var_mean(x, (0, 1), correction=0)[1],
              x.prod(-1), iv.prod(0), x.softmax(-1), x.softmax(1), x.log_softmax(-1), x.max(), iv.amax(-1),
              torch.topk(x, 3, dim=-1)[0], torch.topk(x, 3, dim=-1)[1], torch.topk(x, 2, dim=1, largest=False)[0]]
        # matvec
        a2 = x.reshape(6, 8)
        r += [a2 @ w, torch.addmm(y.reshape(6, 8)[:, :5], a2, w, beta=0.5, alpha=2.0),
              torch.bmm(x, x.transpose(1, 2)), F.linear(a2, w.t(), y[0, 0, :5])]
        # data
        r += [x.permute(2, 0, 1), x.transpose(0, 1), w.t(), x[:, :1].expand(2, 3, 8), x[:, 1:, ::3], x[:, 1],
              x.select(2, -1), torch.cat([x, y, x[:, :, :2]], -1), *torch.split(x, [1, 2], 1),
              *torch.split(x, 3, -1), x.narrow(2, 2, 3), x.repeat(2, 1, 2), F.pad(x, (1, 2, 0, 1), value=-1.0),
              F.pad(x, (-1, 1)), x[ids[0] % 2], x[:, ids[0, :2]], x[ids[0, :2], :, ids[0, :2]],
              x[:, None, ids[0, :1]], x.index_select(1, ids[0, :2]), torch.gather(x, 2, ids[0, :2].expand(2, 3, 2)),
              F.embedding(ids, w.t()), F.embedding(ids, w.t(), padding_idx=1), x.index_put((ids[0, :2],), y[:2] * 2),
              torch.ops.aten.index_put(x, [None, ids[0]], y[:, :1], True),
              torch.ops.aten.index_put(x, [None, ids[0, :2], ids[0, 1:3] + 4], y[:, 0, :1]),
              x.index_copy(1, ids[0, :2], y[:, :2]), x.slice_scatter(y[:, :, :2], 2, 1, 5, 2),
              x.select_scatter(y[:, 1], 1, 2), x.clone()]
        # attention
        q, k = x.reshape(1, 2, 3, 8), y.reshape(1, 2, 3, 8)
        kk = torch.cat([k, k * 0.5], 2)
        bool_mask = (bm.reshape(-1)[:6] | (torch.arange(6, device=x.device) == 0)).reshape(1, 6)
        r += [F.scaled_dot_product_attention(q, kk, kk), F.scaled_dot_product_attention(q, kk, kk, attn_mask=bool_mask),
              F.scaled_dot_product_attention(q, kk, kk, attn_mask=y.reshape(-1)[:18].reshape(1, 3, 6), scale=0.3),
              F.scaled_dot_product_attention(q, k, k, is_causal=True),
              F.scaled_dot_product_attention(q.reshape(1, 2, 3, 8).repeat(1, 2, 1, 1), kk, kk, enable_gqa=True)]
        # broadcasts that read only some coordinates of the output index (inner and outer dims of
        # size 1), a 1-D gather: the generated code declares only the coordinates it reads
        r += [x * x[:, :, :1], x + x[:1, :, :1], y - x[:, :1], torch.gather(x.reshape(-1), 0, ids[0])]
        buf[1:3].copy_(x[0, :2, :buf.shape[1]])
        return tuple(r)


def inputs(seed=0, dtype=torch.float32, device="cpu"):
    """Inputs of :class:`Zoo` (x, y, w, buf in ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    w = torch.randn(8, 5, generator=g)
    ids = torch.tensor([[1, 0, 2, 1]])
    iv = torch.randint(-9, 9, (3, 4), generator=g)
    bm = torch.rand(2, 3, 8, generator=g) > 0.5
    buf = torch.zeros(4, 8)
    d = dict(x=x, y=y, w=w, ids=ids, iv=iv, bm=bm, buf=buf)
    return {k: (v.to(dtype) if v.is_floating_point() else v).to(device) for k, v in d.items()}
