"""The wheel ships every file the compiler reads at run time (issue 30, item 8): a non-editable
install once lacked templates/common.cuh and generic_ops.cuh, and rendering failed at
``{% include "common.cuh" %}``. The full check (install the wheel, compile the tiny example from
outside the tree) is ``make wheel-check`` (tools/wheel_check.sh), which CI runs after the tests."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _template_files() -> list[str]:
    """Every data file of templates/ (relative paths), the Python package file aside."""
    return sorted(str(p.relative_to(ROOT / "templates")) for p in (ROOT / "templates").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".py", ".pyc"))


def test_every_template_file_is_package_data():
    import fnmatch
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "fusec.templates"]

    def shipped(rel: str) -> bool:
        for p in patterns:
            if p.startswith("**/") and fnmatch.fnmatch(Path(rel).name, p[3:]):
                return True
            if fnmatch.fnmatch(rel, p) and "/" not in rel:
                return True
        return False
    files = _template_files()
    assert "common.cuh" in files and "generic_ops.cuh" in files and "kernel.cu.j2" in files
    assert not [f for f in files if not shipped(f)], patterns


def test_wheel_contains_every_template(tmp_path):
    """Build the wheel (no isolation, no dependencies: a few seconds) from a copy of the package
    sources and list it."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("fusec", "passes", "templates"):
        shutil.copytree(ROOT / d, src / d, ignore=ignore)
    for f in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / f, src / f)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("fusec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in _template_files() if f"fusec/templates/{f}" not in names]
    assert not missing, missing
    assert "fusec/passes/__init__.py" in names and "fusec/cli.py" in names


def test_ci_runs_the_tests_then_the_wheel_check():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "make wheel-check" in ci
    assert ci.index("make test") < ci.index("make wheel-check")
    makefile = (ROOT / "Makefile").read_text()
    assert "\nwheel-check:" in makefile and "tools/wheel_check.sh" in makefile
