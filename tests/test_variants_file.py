"""benchmarks/variants.py's variants files (``--variants @FILE``), checked on the CPU before a device
call spends time on them."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import variants  # noqa: E402

from fusec.config import Options  # noqa: E402


@pytest.mark.parametrize("name", ["latency-knobs.json", "latency-combos.json", "attn-lanes.json", "attn-scatter.json",
                                  "norm-vec.json"])
def test_variants_file_parses_and_names_only_known_knobs(name):
    """benchmarks/latency-*.json (``variants.py --variants @FILE``) are lists of uniquely named
    variants whose defines are all kernel knobs, so a device call does not fail on a typo."""
    runs = variants._variants("@" + str(Path(__file__).resolve().parent.parent / "benchmarks" / name))
    assert "base" in [r["name"] for r in runs] and len({r["name"] for r in runs}) == len(runs)
    for r in runs:
        Options.from_dict(r.get("options", {}))   # raises FusecError on an unknown knob
    with pytest.raises(argparse.ArgumentTypeError, match="no such variants file"):
        variants._variants("@/nonexistent/variants.json")
    with pytest.raises(argparse.ArgumentTypeError, match="not a JSON list"):
        variants._variants("[{")
