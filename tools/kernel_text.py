"""Hash the machine code of default megakernels, to tell whether a source change changes it.

Renders and compiles (NVRTC, sm_90a, no GPU needed) the tiny Llama (bf16) and tiny Qwen3 (fp32)
decode steps on 12 SMs, with attention_merge last_tile and reduce, and with ``--big`` the
Llama-3.2-1B step on 132 SMs. For each it records the SHA-256 of the CUBIN's ``.text.*``,
``.nv.shared.*`` and ``.nv.constant0.*`` ELF sections, the registers and the dynamic shared
memory, and writes them as JSON (``FUSEC_DEFINES`` picks knob values for both lowering and
rendering). Compare two runs (before and after a change) with ``diff``.

Usage: .venv/bin/python tools/kernel_text.py OUT.json [--big]
"""
from __future__ import annotations

import hashlib
import json
import logging
import runpy
import struct
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import hf_tiny  # noqa: E402
from fusec.api import compile_model  # noqa: E402
from fusec.cuda.codegen import render  # noqa: E402
from fusec.cuda.jit import compile_cuda  # noqa: E402


def sections(elf: bytes) -> dict[str, str]:
    """Section name -> SHA-256 of its bytes (size for NOBITS) for code, shared and constant sections."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    hdr = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    stro = hdr[shstrndx][4]
    out = {}
    for h in hdr:
        name = elf[stro + h[0]: elf.index(b"\0", stro + h[0])].decode()
        if name.startswith((".text", ".nv.shared", ".nv.constant0")):
            out[name] = f"nobits {h[5]}" if h[1] == 8 else f"{h[5]} {hashlib.sha256(elf[h[4]:h[4] + h[5]]).hexdigest()}"
    return out


def entry(plan) -> dict:
    k = compile_cuda(plan.source, "fusec_step.cu")
    return {"sections": sections(k.cubin), "registers": k.resources["fusec_step"]["registers"],
            "smem_bytes": plan.smem_bytes}


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    res = {}
    for name, factory, dtype in [("llama_bf16", hf_tiny.llama, torch.bfloat16), ("qwen3_fp32", hf_tiny.qwen3, torch.float32)]:
        model = factory().to(dtype)
        cache = hf_tiny.static_cache(model, 32)
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 3)), past_key_values=cache, use_cache=True)
        step = {"input_ids": torch.randint(0, 128, (1, 1)), "past_key_values": cache, "use_cache": True}
        for merge in ("last_tile", "reduce"):
            r = compile_model(model, (), step, {"num_sms": 12, "attention_merge": merge})
            res[f"{name}/{merge}"] = entry(render(r.schedule, defines=r.opts.defines))
    if "--big" in sys.argv:
        model, args, kwargs = runpy.run_path(str(ROOT / "examples" / "llama_3_2_1b.py"))["build"]()
        r = compile_model(model, args, kwargs, {"num_sms": 132})
        res["llama_3_2_1b/last_tile"] = entry(render(r.schedule, defines=r.opts.defines))
    Path(sys.argv[1]).write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    for k, v in res.items():
        print(f"{k}: {v['registers']} registers, {v['smem_bytes']} B dynamic shared memory, "
              f"text {sum(int(s.split()[0]) for n, s in v['sections'].items() if n.startswith('.text'))} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
