"""Tests of fusec.cuda.jit: NVRTC to sm_90a CUBIN, ptxas resource report, disk cache. CPU only."""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from fusec.cuda import jit  # noqa: E402
from fusec.errors import JitError  # noqa: E402

BF16_SRC = r"""
#include <cuda_bf16.h>
extern "C" __global__ void scale_bf16(const __nv_bfloat16* x, __nv_bfloat16* y, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16(__bfloat162float(x[i]) * s);
}
"""

# A runtime-indexed local array cannot live in registers: ptxas gives it a stack frame.
STACK_SRC = r"""
extern "C" __global__ void local_array(float* y, int j) {
    float a[256];
    for (int i = 0; i < 256; ++i) a[i] = y[i] * i;
    a[j & 255] += 1.0f;
    y[0] = a[(j * 7) & 255];
}
"""


def test_compile_bf16_kernel(tmp_path):
    k = jit.compile_cuda(BF16_SRC, name="bf16.cu", cache_dir=str(tmp_path))
    assert k.cubin.startswith(b"\x7fELF")
    assert not k.cache_hit
    assert k.source == BF16_SRC
    assert k.nvrtc_version >= (12, 0)
    res = k.resources["scale_bf16"]
    assert res["entry"] is True
    assert res["registers"] > 0
    assert res["spill_store_bytes"] == 0 and res["spill_load_bytes"] == 0
    assert res["stack_frame_bytes"] == 0
    k.assert_no_spills()
    jit.assert_no_spills(k)


def test_second_compile_is_cache_hit(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    first = jit.compile_cuda(BF16_SRC)
    second = jit.compile_cuda(BF16_SRC)
    assert not first.cache_hit and second.cache_hit
    assert second.cubin == first.cubin
    assert second.resources == first.resources
    assert second.log == first.log
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".cubin", ".json"]
    # Different options are a different key.
    third = jit.compile_cuda(BF16_SRC, options=("-DUNUSED=1",))
    assert not third.cache_hit


def test_syntax_error_raises_jit_error(tmp_path):
    src = 'extern "C" __global__ void broken(int* x) { x[0] = ; }\n'
    with pytest.raises(JitError) as info:
        jit.compile_cuda(src, name="broken_kernel.cu", cache_dir=str(tmp_path))
    msg = str(info.value)
    assert "broken_kernel.cu" in msg
    assert "expected an expression" in msg
    assert "NVRTC_ERROR_COMPILATION" in msg
    assert not list(tmp_path.glob("*.cubin"))


def test_local_array_reported_by_no_spill_check(tmp_path):
    k = jit.compile_cuda(STACK_SRC, name="stack.cu", cache_dir=str(tmp_path))
    assert k.resources["local_array"]["stack_frame_bytes"] > 0
    with pytest.raises(JitError, match=r"local_array: .*stack_frame_bytes=\d+"):
        k.assert_no_spills()


@pytest.mark.parametrize("damage", ["truncate_cubin", "garbage_json", "missing_cubin"])
def test_corrupt_cache_entry_is_recompiled(tmp_path, damage, caplog):
    first = jit.compile_cuda(BF16_SRC, cache_dir=str(tmp_path))
    (cubin_path,) = tmp_path.glob("*.cubin")
    (json_path,) = tmp_path.glob("*.json")
    if damage == "truncate_cubin":
        cubin_path.write_bytes(first.cubin[: len(first.cubin) // 2])
    elif damage == "garbage_json":
        json_path.write_text("{not json")
    else:
        cubin_path.unlink()
    with caplog.at_level(logging.DEBUG, logger="fusec.cuda.jit"):
        again = jit.compile_cuda(BF16_SRC, cache_dir=str(tmp_path))
    assert not again.cache_hit
    assert again.cubin == first.cubin
    if damage != "missing_cubin":
        assert "ignoring corrupt cache entry" in caplog.text
    # The entry was rewritten whole: the next call hits.
    assert jit.compile_cuda(BF16_SRC, cache_dir=str(tmp_path)).cache_hit
    assert not list(tmp_path.glob("*.tmp"))


def test_parse_ptxas_resources_formats():
    text = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 8 bytes cumulative stack size, 512 bytes smem
ptxas info    : Function properties for _Z1fPfi
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function '_Z3oldPf' for 'sm_80'
ptxas info    : Function properties for _Z3oldPf
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, 360 bytes cmem[0], 64 bytes cmem[3]
"""
    res = jit.parse_ptxas_resources(text)
    assert res["k"]["registers"] == 32 and res["k"]["barriers"] == 1
    assert (res["k"]["stack_frame_bytes"], res["k"]["spill_store_bytes"],
            res["k"]["spill_load_bytes"]) == (8, 4, 12)
    assert res["k"]["smem_bytes"] == 512 and res["k"]["cumulative_stack_bytes"] == 8
    assert res["_Z1fPfi"]["entry"] is False
    assert res["_Z3oldPf"]["cmem_bytes"] == 424
    assert res["_Z3oldPf"]["cmem_banks"] == {"0": 360, "3": 64}


def test_constant_memory_from_cubin_sections(tmp_path):
    src = r"""
__constant__ float table[8];
extern "C" __global__ void use_table(float* y) { y[threadIdx.x] = table[threadIdx.x & 7]; }
"""
    res = jit.compile_cuda(src, name="cmem.cu", cache_dir=str(tmp_path)).resources["use_table"]
    assert res["cmem_banks"]["3"] == 32  # the user __constant__ bank
    assert res["cmem_banks"]["0"] > 0  # kernel parameters + driver constants
    assert res["cmem_bytes"] == sum(res["cmem_banks"].values())


def _compile_in_child(cache_dir: str) -> tuple[bool, bytes]:
    k = jit.compile_cuda(BF16_SRC, name="race.cu", cache_dir=cache_dir)
    return k.cache_hit, k.cubin


def test_concurrent_processes_share_cache(tmp_path):
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(4, mp_context=ctx) as pool:
        results = list(pool.map(_compile_in_child, [str(tmp_path)] * 8))
    assert len({cubin for _, cubin in results}) == 1
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".cubin", ".json"]
    assert jit.compile_cuda(BF16_SRC, name="race.cu", cache_dir=str(tmp_path)).cache_hit
