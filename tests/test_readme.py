"""README.md's Python examples run as pasted (issue 30, item 11): every ```python block, in order,
in one namespace (a block may use what an earlier one defined), on the CPU (the simulator).

A block whose first line is ``# gpu`` (needs a CUDA device) or ``# network`` (downloads
something) is skipped explicitly, with its reason, unless that is available (``# gpu``: a CUDA
device). Each block is one test case, run in the README's order.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[int, str]]:
    """(line number, code) of each ```python block of README.md."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in BLOCK.finditer(text)]


BLOCKS = _blocks()


@pytest.fixture(scope="module")
def namespace(tmp_path_factory):
    """One namespace for every block; the blocks run in a temporary folder (the torch.compile
    example dumps into ./build/dump) with their own artifact cache."""
    import os
    import torch._dynamo
    d = tmp_path_factory.mktemp("readme")
    old_cwd, old_env = os.getcwd(), os.environ.get("FUSEC_CACHE_DIR")
    os.chdir(d)
    os.environ["FUSEC_CACHE_DIR"] = str(d / "cache")
    torch._dynamo.reset()
    try:
        yield {"__name__": "__readme__"}
    finally:
        torch._dynamo.reset()
        os.chdir(old_cwd)
        if old_env is None:
            os.environ.pop("FUSEC_CACHE_DIR", None)
        else:
            os.environ["FUSEC_CACHE_DIR"] = old_env


def test_readme_has_its_examples():
    assert len(BLOCKS) >= 5
    assert any("fusec.generate(" in code for _, code in BLOCKS)
    assert not any("{...}" in code for _, code in BLOCKS)   # no placeholders


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_readme_block_runs_as_pasted(namespace, line, code):
    first = code.lstrip().splitlines()[0].strip() if code.strip() else ""
    if first == "# network":
        pytest.skip(f"README.md:{line} needs the network (# network)")
    if first == "# gpu" and not torch.cuda.is_available():
        pytest.skip(f"README.md:{line} needs a CUDA device (# gpu)")
    from fusec.fallbacks import FallbackWatch
    with FallbackWatch() as w:
        exec(compile(code, f"README.md:{line}", "exec"), namespace)
    assert not w.fallbacks, w.fallbacks   # a README example that falls back shows nothing of fusec
    if "backend=\"fusec\"" in code or "fusec.generate(" in code:
        assert w.compiled, "fusec compiled nothing (HF skipped compiling?)"
