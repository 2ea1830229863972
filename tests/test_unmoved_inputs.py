"""CudaStep's per-call check of its inputs (fusec/runtime/cuda_step.py ``_unmoved``): the ~200
weights and KV caches of a decode step are compared at once (object ids and addresses) before
any input is checked one by one. The logic is checked on the CPU with CPU tensors standing in
for device ones (the method reads no CUDA state); the GPU tests run it in every decode step."""
from __future__ import annotations

import torch

from fusec.runtime.cuda_step import CudaStep


def _step(args: list) -> CudaStep:
    """A CudaStep's input bookkeeping alone, as ``__init__`` leaves it after ``args``: inputs 0-2
    compared at once (input 2 of a run-time length), input 3 staged (checked one by one)."""
    s = CudaStep.__new__(CudaStep)
    s.input_pos = {"w": 0, "k": 1, "kv": 2, "ids": 3}
    s._staging = {"ids": torch.empty(1, 1, dtype=torch.long)}
    s._sym_in = {2: ("kv", ((0, "L"),))}
    s._sizes = {2: args[2].shape}
    s.seen = [a.data_ptr() for a in args]
    s._init_unmoved(args)
    return s


def test_only_the_same_objects_at_the_same_addresses_skip_the_check():
    w, k, kv, ids = torch.randn(8, 4), torch.randn(4), torch.randn(6, 2), torch.zeros(1, 1, dtype=torch.long)
    s = _step([w, k, kv, ids])
    assert s._rest == [("ids", 3)]
    assert s._unmoved([w, k, kv, torch.ones(1, 1, dtype=torch.long)])   # a new token: checked alone
    w.data = torch.randn(8, 4)                                           # rebound through .data
    assert not s._unmoved([w, k, kv, ids])
    s._fast_seen[0] = w.data_ptr()
    assert s._unmoved([w, k, kv, ids])
    assert not s._unmoved([w, k.view(4), kv, ids])                      # a view at the same address
    assert not s._unmoved([w, k, kv[:3], ids])                           # another run-time length
    s._fast_refs = None                                                  # a call that raised midway
    assert not s._unmoved([w, k, kv, ids])
