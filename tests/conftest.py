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
# The artifact cache (fusec/cache/artifacts.py) never reads what an earlier run left in
# ~/.cache/fusec: outside a run-wide folder (below) it is off, and the tests of the cache itself
# (tests/test_artifact_cache.py, test_warm_start.py, test_precompiled.py) turn it on in folders of
# their own.
os.environ.setdefault("FUSEC_CACHE", "0")
if not torch.cuda.is_available():
    # A graph fusec does not take runs eagerly in this suite, not through inductor: inductor's
    # CPU code is C++ that it compiles with the system's compiler, 15-20 s for one fallback
    # graph on a cold cache (test_multi_token.py took 122 s instead of 58 s, 2026-12-05), and
    # what these tests check is fusec's choice and its log line, whose values eager gives as
    # well. Options that name a fallback keep it (tests/test_fallback.py runs inductor's).
    os.environ.setdefault("FUSEC_FALLBACK", "eager")
    # dynamo's own per-compile costs that this suite does not need: a gc.collect(1) after each
    # compile (the collector is tuned below) and a timed pass over the new guards for a debug
    # log line ("Guard eval latency"), about 40 ms each per compile; ~900 compiles in a run
    torch._dynamo.config.run_gc_after_compile = False
    import torch._dynamo.guards as _dynamo_guards
    if hasattr(_dynamo_guards, "profile_guard_manager"):
        _dynamo_guards.profile_guard_manager = lambda *args, **kwargs: 0.0
#: the run-wide artifact cache folder, made empty by the run's first process (pytest_configure,
#: inherited by xdist's workers); "" where FUSEC_CACHE was set by whoever started the run
SHARED_CACHE_ENV = "FUSEC_TEST_SHARED_CACHE"


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


def pytest_sessionfinish(session):
    """Without a GPU, the objects alive at the end of the session are frozen out of the
    collector too: pytest's unraisable-exception plugin then collects five times over the
    whole heap of the run's compiles (8 s per process, measured 2026-12-05)."""
    if not torch.cuda.is_available():
        gc.freeze()


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


def pytest_configure(config):
    """A run-wide artifact cache, shared by the tests (and xdist's workers) of this run only: a
    decode step that several tests compile alike (the same captured graph, options and fusec
    source: the cache's key) is lowered once, later compiles load it (AOT autograd and the passes
    skipped, :mod:`fusec.frontend.warm`) and a generate() path's dynamo trace is loaded too
    (:mod:`fusec.frontend.precompiled`). The folder is new and empty for each run and removed
    after it: no test reads what another run left. Tests that change fusec's state with
    ``monkeypatch`` (a module constant, an env knob: what the key cannot see) run with the cache
    off (:func:`_run_wide_artifact_cache`). Off where the run was started with FUSEC_CACHE set."""
    if hasattr(config, "workerinput") or SHARED_CACHE_ENV in os.environ:
        return   # a worker: the controller made it (its environment is inherited)
    if os.environ.get("FUSEC_CACHE", "0") != "0" or "FUSEC_CACHE_DIR" in os.environ:
        os.environ[SHARED_CACHE_ENV] = ""
        return
    import tempfile
    folder = tempfile.mkdtemp(prefix="fusec-test-cache-")
    os.environ[SHARED_CACHE_ENV] = folder
    config._fusec_shared_cache = folder


def pytest_unconfigure(config):
    folder = getattr(config, "_fusec_shared_cache", None)
    if folder:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)


#: environment variables whose change never makes a cached step stale (the tests of the cache set
#: them to folders of their own)
_CACHE_NEUTRAL_ENV = {"FUSEC_CACHE", "FUSEC_CACHE_DIR", "FUSEC_DUMP", "OMP_NUM_THREADS"}


def _cache_off_unless_own() -> None:
    """A test changes fusec's state through monkeypatch: no run-wide cache from here on (unless the
    test pointed FUSEC_CACHE_DIR at a folder of its own)."""
    shared = os.environ.get(SHARED_CACHE_ENV)
    if shared and os.environ.get("FUSEC_CACHE_DIR") == shared:
        os.environ["FUSEC_CACHE"] = "0"


def _watch(name: str):
    orig = getattr(pytest.MonkeyPatch, name)

    def patched(self, *args, **kwargs):
        if name in ("setenv", "delenv"):
            neutral = (args[0] if args else kwargs.get("name")) in _CACHE_NEUTRAL_ENV
        elif name in ("setitem", "delitem") and args and args[0] is os.environ:   # setenv's own way
            neutral = len(args) > 1 and args[1] in _CACHE_NEUTRAL_ENV
        else:   # setattr(target, name, value): the steps fixture's recorder changes nothing cached
            neutral = getattr(args[2] if len(args) > 2 else kwargs.get("value"), "keeps_cache", False)
        if not neutral:
            _cache_off_unless_own()
        return orig(self, *args, **kwargs)
    patched.__doc__ = orig.__doc__
    setattr(pytest.MonkeyPatch, name, patched)


for _name in ("setattr", "delattr", "setitem", "delitem", "setenv", "delenv"):
    _watch(_name)


@pytest.fixture(autouse=True)
def _run_wide_artifact_cache():
    """Each test starts with the run-wide artifact cache on (:func:`pytest_configure`); the
    environment is put back after it."""
    shared = os.environ.get(SHARED_CACHE_ENV)
    if not shared:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("FUSEC_CACHE", "FUSEC_CACHE_DIR")}
    os.environ["FUSEC_CACHE"], os.environ["FUSEC_CACHE_DIR"] = "1", shared
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
