"""Show where a rendered kernel's device functions wait on memory: the PTX of one function with
its global loads, branches, barriers and shuffles, no GPU needed.

How this project found its dependent L2 round trips (docs/performance.md, section 16): a load whose
value is used before the next load is issued (a loop whose loads sit behind its exit branch, a
residual loaded after the dot product) costs a round trip each; loads issued back to back cost
one together. PTX is NVRTC's output for ``compute_90a`` (ptxas may still reorder a little; no
SASS disassembler is needed).

Usage:
  .venv/bin/fusec compile examples/llama_3_2_1b.py -o /tmp/k --emit-cuda
  .venv/bin/python tools/kernel_ptx.py /tmp/k/kernel.cu                       # list the functions
  .venv/bin/python tools/kernel_ptx.py /tmp/k/kernel.cu matvec_residual       # its memory lines
  .venv/bin/python tools/kernel_ptx.py /tmp/k/kernel.cu attention --define FUSEC_ATTN_KV_EARLY=0 --full
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fusec.cuda.jit import compile_ptx  # noqa: E402

#: PTX lines worth seeing when looking for dependent round trips
INTERESTING = re.compile(r"\b(ld\.global|st\.global|atom\.|red\.|bar\.sync|bra|shfl|prefetch)|^\$L")


def functions(ptx: str) -> dict[str, str]:
    """Mangled name -> body of every ``.func`` / ``.entry`` with a body in ``ptx``."""
    out, lines = {}, ptx.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^\.(?:visible \.)?(?:func|entry)\s+(?:\([^)]*\)\s*)?(\w+)", line)
        if m and i + 1 < len(lines) and not lines[i].rstrip().endswith(";"):
            end = next((j for j in range(i, len(lines)) if lines[j] == "}"), len(lines) - 1)
            if any(lines[k].startswith("{") for k in range(i, min(end, i + 60))):
                out[m.group(1)] = "\n".join(lines[i:end + 1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel_cu", help="kernel.cu written by fusec compile --emit-cuda (or FUSEC_DUMP)")
    ap.add_argument("function", nargs="?", help="part of a device function's name (default: list them)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="set a kernel knob's #define (e.g. FUSEC_ATTN_KV_EARLY=0)")
    ap.add_argument("--full", action="store_true", help="print the whole PTX body, not only the memory lines")
    ns = ap.parse_args()
    source = Path(ns.kernel_cu).read_text()
    for d in ns.define:
        name, _, value = d.partition("=")
        source, n = re.subn(rf"^#define {re.escape(name)} .*$", f"#define {name} {value}", source, flags=re.M)
        if not n:
            sys.exit(f"{ns.kernel_cu}: no '#define {name}' line to set")
    funcs = functions(compile_ptx(source))
    if ns.function is None:
        for name, body in funcs.items():
            print(f"{body.count(chr(10)) + 1:6d} lines  {name}")
        return 0
    hits = {n: b for n, b in funcs.items() if ns.function in n}
    if not hits:
        sys.exit(f"no function whose name contains {ns.function!r}; run without it to list them")
    for name, body in hits.items():
        print(f"// {name}")
        for k, line in enumerate(body.splitlines(), 1):
            if ns.full or INTERESTING.search(line.strip()):
                print(f"{k:5d}: {line.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
