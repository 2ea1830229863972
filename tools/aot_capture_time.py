"""AOT autograd's capture against one functionalized ``make_fx`` trace of the same dynamo graph,
on the CPU (docs/testing.md, "The next lever"): the cost a single-trace capture would save on
every compile.

A tiny Llama (``tests/hf_tiny.py``, ``--layers`` layers) decodes one token over a 64-row
StaticCache under ``torch.compile`` with a backend that only records dynamo's graph and example
inputs; then each capture runs ``--repeat`` times and prints its mean milliseconds and ATen op
count: ``aot_module_simplified`` as fusec calls it (``fusec/frontend/capture.py``: inference,
input mutations kept, core ATen decompositions) and ``make_fx(functionalize(gm,
remove="mutations"))`` with the same decompositions under the python dispatcher, dead code out
(AOT's graph op for op; fake tensors made from the real inputs: static shapes only). Outside
dynamo, as here, AOT makes fakes of its own: inside the suite's captures the gap is smaller
(docs/testing.md).

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python tools/aot_capture_time.py [--layers 2] [--repeat 3]``
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import torch
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch.fx.experimental.proxy_tensor import make_fx

    import hf_tiny
    from fusec.frontend.capture import decompositions

    got = {}

    def record(gm, example_inputs):
        got["gm"], got["ex"] = gm, example_inputs
        return gm.forward

    model = hf_tiny.llama(layers=args.layers)
    cache = hf_tiny.static_cache(model, 64)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 4)), past_key_values=cache, use_cache=True)
        torch._dynamo.reset()
        torch.compile(model, backend=record)(input_ids=torch.randint(0, 128, (1, 1)), past_key_values=cache,
                                             use_cache=True)
    gm, ex = got["gm"], got["ex"]

    def aot():
        out = {}

        def fw(g, _):
            out["g"] = g
            return g.forward
        aot_module_simplified(gm, ex, fw_compiler=fw, decompositions=decompositions(),
                              keep_inference_input_mutations=True)
        return out["g"]

    def single():   # under the python dispatcher, as AOT traces, and dead code out: AOT's graph
        from torch._dispatch.python import enable_python_dispatcher
        with enable_python_dispatcher():
            g = make_fx(torch.func.functionalize(gm, remove="mutations"), decomposition_table=decompositions(),
                        tracing_mode="fake")(*ex)
        g.graph.eliminate_dead_code()
        return g

    for name, fn in (("aot_module_simplified", aot), ("make_fx(functionalize)", single)) * 2:
        t = time.perf_counter()
        for _ in range(args.repeat):
            g = fn()
        ms = (time.perf_counter() - t) / args.repeat * 1e3
        ops = sum(1 for n in g.graph.nodes if n.op == "call_function")
        print(f"{name:24s} {ms:6.0f} ms  {ops} ATen ops  ({len(ex)} inputs, {args.layers} layers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
