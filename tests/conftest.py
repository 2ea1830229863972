import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# The artifact cache (fusec/runtime/artifacts.py) is off in the tests, so that no test depends on
# what an earlier run left in ~/.cache/fusec; tests/test_artifact_cache.py turns it on itself.
os.environ.setdefault("FUSEC_CACHE", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def steps(monkeypatch):
    """Every ``fusec.runtime.compiled.CompiledStep`` built while the test runs (to look at the graphs and
    schedules fusec compiled behind ``torch.compile``)."""
    from fusec.runtime.compiled import CompiledStep
    made: list = []
    init = CompiledStep.__init__

    def record(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)
    monkeypatch.setattr(CompiledStep, "__init__", record)
    return made
