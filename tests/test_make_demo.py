"""``make demo``, the README's first command, as the Makefile spells it (issue 30, item 11).

``make -n demo`` prints the recipe without running it; each ``fusec compile`` line must name an
existing model file and flags the CLI takes, and the tiny model's line, run as written (only its
``-o`` folder moved under the test's), must print the simulator's numeric check against eager.
The Llama-3.2-1B line is not run here (its full-depth structure check takes minutes on a CPU);
its file and flags are checked like the tiny one's.
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from fusec.cli import _parser, main

ROOT = Path(__file__).resolve().parents[1]


def _demo_lines() -> list[list[str]]:
    """The ``fusec compile`` commands of ``make -n demo``, as argument lists after ``fusec``."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    out = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = []
    for line in out.stdout.splitlines():
        argv = shlex.split(line)
        if len(argv) > 1 and Path(argv[0]).name == "fusec" and argv[1] == "compile":
            lines.append(argv[1:])
    return lines


def test_make_demo_compiles_two_existing_models_with_valid_flags():
    """Both demo lines parse with the CLI's own parser and name example files that exist: the
    tiny model for the numeric check, the 1B for the structure at full depth."""
    lines = _demo_lines()
    assert len(lines) == 2, lines
    models = []
    for argv in lines:
        ns = _parser().parse_args(argv)
        assert (ROOT / ns.model_py).is_file(), ns.model_py
        assert ns.simulate, argv
        models.append(Path(ns.model_py).name)
    assert models == ["tiny_llama.py", "llama_3_2_1b.py"]


def test_make_demo_tiny_line_prints_the_numeric_check(tmp_path, capsys, monkeypatch):
    """The demo's first line, run as the Makefile has it (default options: 132 SMs), compares
    the simulated step with eager number for number and prints the error it measured."""
    argv = _demo_lines()[0]
    i = argv.index("-o")
    argv[i + 1] = str(tmp_path / "demo-tiny")
    monkeypatch.chdir(ROOT)
    code = main(argv)
    cap = capsys.readouterr()
    assert code == 0, cap.err
    m = re.search(r"one step numeric: 1 output and \d+ written buffers match eager \(max rel err (\S+), "
                  r"tolerance", cap.out)
    assert m, cap.out
    assert 0 < float(m.group(1)) < 1e-4
