"""A folder named ``fusec`` without ``__init__.py`` in the directory a script runs from (a clone
of the repository, found by a new user's trial 2026-12-07) shadows an editable install: ``import
fusec`` becomes a namespace package whose submodules still load, and the failure came from deep
inside torch.compile (``module 'fusec' has no attribute '__version__'``). Now the first import of
``fusec.frontend`` (torch.compile's backend entry point) is one ImportError that says so."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fusec.package_check import check_package

SCRIPT = """
import sys
import fusec
if getattr(fusec, "__file__", None) is not None:
    print("NOT-SHADOWED"); sys.exit(0)
import fusec.frontend.backend
"""


def test_the_real_package_passes_the_check():
    check_package()   # this process imported fusec/__init__.py: nothing raised


def test_a_folder_that_shadows_the_package_is_one_clear_import_error(tmp_path):
    (tmp_path / "fusec").mkdir()   # as the root of a clone is: no __init__.py
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    if "NOT-SHADOWED" in r.stdout:
        pytest.skip("fusec is installed as a regular package on sys.path here (not an editable install's "
                    "import hook): a folder in the working directory cannot shadow it")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: 'import fusec' found the folder ") and str(tmp_path / "fusec") in last \
        and "Run from another directory or rename that folder" in last, r.stderr[-2000:]
