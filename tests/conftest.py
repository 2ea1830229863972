import gc
import os
import sys


def _threads_per_worker() -> int | None:
    """Intra-op threads for one pytest-xdist worker: the cores shared among the workers (None
    outside xdist, or where OMP_NUM_THREADS is set). Every worker is busy on its own core; with
    torch's default (a thread per core in each worker, and in each process a test starts) a
    parallel op waits for a thread the OS has descheduled: on 2 cores, four of the test files
    took 150 s with two workers instead of 103 s."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // max(1, int(workers)))


_THREADS = _threads_per_worker()
if _THREADS is not None:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)   # before torch loads OpenMP; and the processes tests start

import pytest  # noqa: E402
import torch  # noqa: E402

if _THREADS is not None:
    torch.set_num_threads(_THREADS)

sys.path.insert(0, os.path.dirname(__file__))
# The artifact cache (fusec/cache/artifacts.py) is off in the tests, so that no test depends on
# what an earlier run left in ~/.cache/fusec; tests/test_artifact_cache.py turns it on itself.
os.environ.setdefault("FUSEC_CACHE", "0")


#: test files whose tests share nothing and may run in any order (each builds its own model):
#: pytest_xdist_make_scheduler hands them to the workers one test at a time
INDEPENDENT_FILES = ("test_fuzz_configs.py",)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, but the tests of :data:`INDEPENDENT_FILES` are scheduled one by one.
    xdist hands out the files with the most tests first, so these single tests come last and
    fill both workers to the end: as one file on one worker, the 96 fuzz configurations (an
    eighth of the suite's CPU time) would bound ``make test`` once the rest takes less."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return nodeid if os.path.basename(file) in INDEPENDENT_FILES else file

    return Scheduling(config, log)


def pytest_collection_finish(session):
    """Python's cyclic garbage collector, tuned for this suite on a machine without a GPU: the
    objects alive after collection (torch's, transformers' and the test modules') are frozen out
    of it, and it runs after 100000 new objects instead of 700. A compile makes millions of
    short-lived objects, and each collection of the oldest generation walked every live one
    (0.1-0.2 s): the collector took 10-15% of the suite's CPU time (fusec.pipeline.gc_paused is
    the same trade in the passes). About 100 MB more per worker. With a GPU the defaults stay: a
    step's device memory goes back only when the collector frees it."""
    if torch.cuda.is_available():
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 20, 20)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def steps(monkeypatch):
    """Every ``fusec.frontend.compiled.CompiledStep`` built while the test runs (to look at the graphs and
    schedules fusec compiled behind ``torch.compile``)."""
    import step_util
    return step_util.record_compiled_steps(monkeypatch)
