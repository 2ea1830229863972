"""The warm start (fusec/frontend/warm.py): AOT autograd is skipped only where its runtime
wrapping is the identity, the key tells graphs and input layouts apart, and a dump or a
disabled cache always runs the full capture."""
from __future__ import annotations

import pytest
import torch

from fusec.config import Options
from fusec.frontend import warm
from fusec.frontend.capture import aten_capture


def _problems(fn, *inputs) -> tuple[list, object]:
    """Compile ``fn`` (no grad) with a backend that captures to ATen as fusec does and records
    :func:`warm.aot_identity_problem` per graph; returns (the problems, fn's compiled result)."""
    seen = []

    def backend(gm, example_inputs):
        def compiler(aten_gm, flat):
            seen.append(warm.aot_identity_problem(gm, example_inputs, aten_gm, flat))
            return aten_gm
        return aten_capture(gm, example_inputs, compiler)

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return seen, got


def _identity_problem(fn, *inputs):
    """(the one graph's problem, fn's compiled result, its eager result) on copies of ``inputs``."""
    seen, got = _problems(fn, *[x.clone() for x in inputs])
    with torch.no_grad():
        want = fn(*[x.clone() for x in inputs])
    assert len(seen) == 1
    return seen[0], got, want


def test_a_plain_graph_is_the_identity():
    problem, got, want = _identity_problem(lambda x, w: (x @ w).relu() + 1, torch.randn(3, 5), torch.randn(5, 4))
    assert problem is None
    torch.testing.assert_close(got, want)


def test_an_in_place_update_of_an_input_stays_in_the_graph_and_bumps_its_version():
    def step(cache, x):
        cache.index_copy_(0, torch.tensor([1]), x)
        return cache.sum(0) * 2
    problem, _, _ = _identity_problem(step, torch.randn(4, 3), torch.randn(1, 3))
    assert problem is None
    bumps = []

    def backend(gm, example_inputs):
        def compiler(aten_gm, flat):
            bumps.append(warm.mutated_inputs(example_inputs))
            return aten_gm
        return aten_capture(gm, example_inputs, compiler)

    torch._dynamo.reset()
    cache, x = torch.randn(4, 3), torch.randn(1, 3)
    with torch.no_grad():
        torch.compile(step, backend=backend, fullgraph=True)(cache, x)
    assert bumps == [[0]]
    # the warm step bumps the same inputs after each call, as AOT's wrapper does
    before = cache._version
    warm.WarmStep(lambda c, y: [c.sum(0)], [0])(cache, x)
    assert cache._version == before + 1


def test_an_output_that_is_a_view_of_an_input_is_refused():
    problem, _, _ = _identity_problem(lambda x: x.view(-1), torch.randn(3, 4))
    assert problem is not None and "alias" in problem, problem


def test_inputs_merged_into_a_synthetic_base_are_refused():
    """Two inputs sharing storage, one mutated: AOT passes one base for both."""
    def f(a, b):
        b.add_(1)
        return a * 2

    a = torch.randn(4, 3)
    seen, _ = _problems(f, a, a[:2])
    assert len(seen) == 1 and seen[0] is not None, seen


def test_the_key_tells_graphs_and_input_layouts_apart():
    keys = {}

    def backend(gm, example_inputs):
        keys.setdefault("k", []).append(warm.dynamo_key(gm, example_inputs))
        return gm.forward

    def f(x):
        return x * 2 + 1

    def g(x):
        return x * 3 + 1

    torch._dynamo.reset()
    for fn, x in ((f, torch.randn(4, 6)), (f, torch.randn(4, 6)), (f, torch.randn(6, 4).t()),
                  (f, torch.randn(4, 6, dtype=torch.float64)), (g, torch.randn(4, 6))):
        torch._dynamo.reset()
        torch.compile(fn, backend=backend, dynamic=False)(x)
    k = keys["k"]
    assert k[0] == k[1]                       # same graph and layout, other values
    assert len({k[0], k[2], k[3], k[4]}) == 4  # strides, dtype, graph


def test_global_modes_are_in_the_key_and_autocast_has_no_warm_start():
    """The same dynamo graph traced under another default dtype makes another ATen graph (a
    tensor created without a dtype); under autocast AOT runs the graph with autocast off, which
    a warm step would not: no key at all."""
    keys = []

    def backend(gm, example_inputs):
        keys.append(warm.dynamo_key(gm, example_inputs))
        return gm.forward

    def f(x):
        return x + torch.full((4,), 0.5)

    x = torch.randn(3, 4)
    for ctx in (torch.no_grad, lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
        torch._dynamo.reset()
        with ctx():
            torch.compile(f, backend=backend)(x)
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(f, backend=backend)(x)
    finally:
        torch.set_default_dtype(old)
    plain, autocast, f64 = keys
    assert plain is not None and autocast is None and f64 is not None and f64 != plain


def test_dump_or_cache_off_runs_the_full_capture(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "c"))
    assert warm.recall("0" * 64, Options.from_dict({"cache": True})) is None   # nothing stored
    from fusec.frontend import backend
    assert backend._warm_key(None, [], Options.from_dict({"cache": False})) is None
    assert backend._warm_key(None, [], Options.from_dict({"cache": True, "dump_dir": str(tmp_path)})) is None


# A user's generate() in a new process, the artifact cache on (its default): tokens, whether
# fusec fell back, and the stage lines (stderr).
GENERATE = """
import json, logging, sys
sys.path.insert(0, sys.argv[1])
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
import torch
import hf_tiny
from transformers.generation import CompileConfig
from fusec.fallbacks import FallbackWatch
model = hf_tiny.llama(seed=int(sys.argv[2]))
model.generation_config.pad_token_id = 0
prompt = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(1))
ref = model.generate(prompt, max_new_tokens=12, do_sample=False, cache_implementation="static")
cc = CompileConfig(backend="fusec", dynamic=True) if sys.argv[3] == "dynamic" else CompileConfig(backend="fusec")
cc._compile_all_devices = True   # HF compiles on CUDA only unless told
with FallbackWatch() as w:
    out = model.generate(prompt, max_new_tokens=12, do_sample=False, cache_implementation="static",
                         compile_config=cc)
print(json.dumps({"equal": torch.equal(out, ref), "fallbacks": list(w.fallbacks), "compiled": w.compiled}))
"""


@pytest.mark.parametrize("dynamic", [False, True], ids=["default", "dynamic"])
def test_generate_in_a_second_process_takes_the_warm_start(tmp_path, dynamic):
    """HF generate() through fusec in two new processes over one artifact cache: the second takes
    the warm start (under HF's default config, with other random weights, it loads the
    precompiled decode step: no dynamo trace) and its tokens equal its own eager model's. With ``CompileConfig(dynamic=True)`` the graph has a symbolic
    cache length, an expanded 4-D mask and dynamo's specialized ``logits_to_keep`` (once a
    graph with no key: every process ran AOT autograd again)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    tests = Path(__file__).resolve().parent
    script = tmp_path / "gen.py"
    script.write_text(GENERATE)
    # torch's own cache folder (dynamo's profile-guided dynamic shapes among it) of these two
    # processes only, not the default one every test process shares: in one loaded run
    # (2026-12-07) the warm process missed the entry of the cold one (not reproduced alone; that
    # shared folder is the one input of theirs other processes write)
    env = {**os.environ, "FUSEC_CACHE": "1", "FUSEC_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch")}
    env.pop("FUSEC_DUMP", None)
    runs = []
    seeds = (0, 0) if dynamic else (0, 1)   # cold; warm (default: with other weights)
    for seed in seeds:
        p = subprocess.run([sys.executable, str(script), str(tests), str(seed),
                            "dynamic" if dynamic else "default"], capture_output=True,
                           text=True, env=env, cwd=str(tests.parent), timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append((json.loads(p.stdout.strip().splitlines()[-1]), p.stderr))
    for res, err in runs:
        assert res["equal"] and not res["fallbacks"] and res["compiled"] > 0, (res, err[-2000:])
    cold, *warm = [err for _, err in runs]
    assert "warm start" not in cold and "stage build_ir" in cold
    for err in warm:
        assert "warm start" in err and "AOT skipped" in err and "stage build_ir" not in err, err[-2000:]
    if not dynamic:   # HF's default config: one precompiled step (fusec.frontend.hf_generate)
        assert "stage precompiled   traced" in cold, cold[-2000:]
        for err in warm:
            assert "stage precompiled   loaded" in err and "stage precompiled   traced" not in err, err[-2000:]


def test_symbolic_layout_names_layouts_that_hold_at_every_length():
    """A symbolic-size input's layout in the warm-start key: contiguous, a contiguous tensor
    broadcast with stride 0 (HF's expanded attention mask), or no key for anything else."""
    mask = torch.ones(1, 1, 7, dtype=torch.bool)
    assert warm.symbolic_layout(torch.zeros(2, 3, 5)) == "contiguous"
    assert warm.symbolic_layout(mask.expand(4, 1, 7)) == "expanded:0"
    assert warm.symbolic_layout(mask[:, :, None, :].expand(1, 1, 3, 7)) == "expanded:2"
    assert warm.symbolic_layout(torch.zeros(6, 4).t()) is None
    assert warm.symbolic_layout(torch.zeros(4, 10)[:, :5]) is None
