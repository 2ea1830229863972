"""The artifact cache (fusec/cache/artifacts.py): a second process skips the passes and the
rendering, binds its own weights, never reuses constants folded from other small-weight values,
misses on an options change, survives a damaged entry and stays under its size cap."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import hf_tiny
from fusec.config import Options
from fusec.errors import FusecError
from fusec.ir import Graph
from fusec.ir.schedule import Schedule
from fusec.cache import artifacts

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
PASS_LINES = ("stage normalize", "stage fold_constants", "stage recognize", "stage fold_position",
              "stage fuse", "stage tile", "stage schedule")

# One decode run as a user writes it: torch.compile(model, backend="fusec") on the CPU (the
# simulator target), three steps against eager; prints the logits, their errors against eager
# and digests of the schedule and of the kernel source rendered from it (last stdout line).
CHILD = textwrap.dedent('''
    import hashlib, json, logging, sys
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, spec["tests"])
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    import torch
    import hf_tiny
    from fusec.frontend.compiled import CompiledStep
    made = []
    init = CompiledStep.__init__
    def record(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)
    CompiledStep.__init__ = record
    model = getattr(hf_tiny, spec["family"])(seed=spec["seed"])
    vocab = model.config.vocab_size
    caches = [hf_tiny.static_cache(model, 32) for _ in range(2)]
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab, (1, 4), generator=gen)
    out = {"errs": [], "logits": []}
    with torch.no_grad():
        for c in caches:
            model(input_ids=prompt, past_key_values=c, use_cache=True)
        compiled = torch.compile(model, backend="fusec", options=spec["options"])
        for _ in range(3):
            tok = torch.randint(0, vocab, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
            out["errs"].append(((a - b).norm() / b.norm()).item())
            out["logits"].append(a.flatten()[:16].tolist())
    from fusec.cuda.codegen import render
    sched = made[-1].schedule
    sha = lambda s: hashlib.sha256(s.encode()).hexdigest()
    out["schedule"] = sha(json.dumps(sched.to_json(), sort_keys=True))
    out["source"] = sha(render(sched).source)
    print(json.dumps(out))
''')


def _child(tmp: Path, cache_dir: Path, family: str = "llama", seed: int = 0, **extra) -> tuple[dict, str]:
    """Run :data:`CHILD` in a new process with the artifact cache on; returns (result, stderr)."""
    spec = {"tests": str(TESTS), "family": family, "seed": seed, "options": {"num_sms": 8}, **extra}
    script = tmp / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "FUSEC_CACHE": "1", "FUSEC_CACHE_DIR": str(cache_dir)}
    env.pop("FUSEC_DUMP", None)
    p = subprocess.run([sys.executable, str(script), json.dumps(spec)], capture_output=True, text=True,
                       env=env, cwd=str(ROOT), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def _steps(folder: Path) -> list[Path]:
    """The lowered-step entries (``<key>.art``; warm-start IR entries are ``<key>.dynamo_ir.art``)."""
    return [p for p in folder.glob("*.art") if p.name.count(".") == 1]


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
    """Three processes over one cache folder: the first compile, the same model again, a model
    with other (random) big weights."""
    tmp = tmp_path_factory.mktemp("artifacts")
    cache = tmp / "cache"
    runs = {}
    for name, kw in (("first", {}), ("again", {}), ("other_weights", {"seed": 1})):
        runs[name] = _child(tmp, cache, **kw)
    runs["cache"] = cache
    return runs


def test_second_process_hits_and_skips_lowering(llama_runs):
    first, err1 = llama_runs["first"]
    again, err2 = llama_runs["again"]
    assert "stage artifacts     miss" in err1 and "stage artifacts     stored" in err1
    assert all(line in err1 for line in PASS_LINES)
    assert "stage artifacts     hit" in err2, err2
    assert not any(line in err2 for line in PASS_LINES), err2
    assert "stage capture" in err2 and "stage load" in err2
    # the warm start (fusec/frontend/warm.py): the IR comes from the cache, AOT autograd is skipped
    assert "warm start" in err2 and "AOT skipped" in err2 and "stage build_ir" not in err2, err2
    assert "stage build_ir" in err1 and "warm start" not in err1
    assert again["schedule"] == first["schedule"] and again["source"] == first["source"]
    assert again["logits"] == first["logits"]
    assert max(first["errs"]) < 1e-4 and max(again["errs"]) < 1e-4
    folder = llama_runs["cache"] / "artifacts"
    assert len(_steps(folder)) == 1 and len(list(folder.glob("*.dynamo_ir.art"))) == 1


def test_other_big_weights_hit_and_compute_with_their_own_values(llama_runs):
    first, _ = llama_runs["first"]
    other, err = llama_runs["other_weights"]
    assert "stage artifacts     hit" in err and not any(line in err for line in PASS_LINES), err
    assert other["source"] == first["source"]
    assert max(other["errs"]) < 1e-4            # against its own eager model
    assert other["logits"] != first["logits"]   # ... which is another model


# ----------------------------------------------------------------------------- in-process

@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE", "1")
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FUSEC_DUMP", raising=False)
    return tmp_path / "cache" / "artifacts"


def _captured(model):
    """(ATen graph, IR, flat inputs) of one decode step of ``model`` after a 3-token prefill."""
    import step_util
    cache = hf_tiny.static_cache(model, 32)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)
    return step_util.capture(model, dict(input_ids=torch.tensor([[4]]), past_key_values=cache, use_cache=True))


_CAPTURED: dict = {}


def _captured_family(family: str):
    """(model, :func:`_captured` of it) for hf_tiny's ``family`` with seed 0, captured once for
    the tests of this file that ask for it (they only read the graph and the inputs: lowering
    copies the graph, the step runs on clones of the caches)."""
    if family not in _CAPTURED:
        model = getattr(hf_tiny, family)(seed=0)
        _CAPTURED[family] = (model, _captured(model))
    return _CAPTURED[family]


def _decode(model, options, n=2, seed=3):
    """n compiled decode steps against eager; returns the max relative error."""
    vocab = model.config.vocab_size
    caches = [hf_tiny.static_cache(model, 32) for _ in range(2)]
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (1, 4), generator=gen)
    errs = []
    torch._dynamo.reset()
    with torch.no_grad():
        for c in caches:
            model(input_ids=prompt, past_key_values=c, use_cache=True)
        compiled = torch.compile(model, backend="fusec", options=options)
        for _ in range(n):
            tok = torch.randint(0, vocab, (1, 1), generator=gen)
            a = compiled(input_ids=tok, past_key_values=caches[0], use_cache=True).logits
            b = model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits
            errs.append(((a - b).norm() / b.norm()).item())
    torch._dynamo.reset()
    return max(errs)


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("fusec")]


def test_other_inv_freq_is_lowered_again(cache_on, caplog):
    """The RoPE tables are folded from inv_freq: an entry made for other values (another rope
    theta) is not reused; the model is right with its own values."""
    def llama(scale: float):
        m = hf_tiny.llama()
        for name, b in m.named_buffers():
            if name.endswith("inv_freq"):
                b.mul_(scale)
        return m
    with caplog.at_level(logging.INFO, logger="fusec"):
        assert _decode(llama(1.0), {"num_sms": 8}, n=1) < 1e-4
        caplog.clear()
        assert _decode(llama(0.5), {"num_sms": 8}, n=3) < 1e-4
        msgs = _messages(caplog)
        assert sum("was compiled for other values of" in m for m in msgs) == 1, msgs
        assert any(m.startswith("stage fold_position") for m in msgs)
        assert any(m.startswith("stage artifacts     stored") for m in msgs)


def test_gemma_norm_weights_compiled_in_are_checked(cache_on, caplog):
    """Gemma's (1 + w) RMSNorm weights are folded into constants: a Gemma with other norm weights
    lowers again (and is right), the same one hits."""
    with caplog.at_level(logging.INFO, logger="fusec"):
        assert _decode(hf_tiny.gemma(seed=0), {"num_sms": 8}) < 1e-4
        caplog.clear()
        assert _decode(hf_tiny.gemma(seed=1), {"num_sms": 8}) < 1e-4
        msgs = _messages(caplog)
        assert any("was compiled for other values of" in m for m in msgs), msgs
        assert any(m.startswith("stage fold_constants") for m in msgs)
        caplog.clear()
        assert _decode(hf_tiny.gemma(seed=1), {"num_sms": 8}) < 1e-4
        msgs = _messages(caplog)
        assert any(m.startswith("stage artifacts     hit") for m in msgs), msgs
        assert not any(m.startswith("stage fold_constants") for m in msgs)


def test_recorded_values_are_the_weights_the_passes_read(cache_on):
    """Llama: only inv_freq (its norm weights are read by the kernel at run time); Gemma: inv_freq,
    the norm weights of its (1 + w) constants and the 0-d embedding scale (a literal of the
    multiplication, fold_constants)."""
    for family, small in (("llama", {"inv_freq"}), ("gemma", {"inv_freq", "norm", "embed_scale"})):
        model, (_, g, flat) = _captured_family(family)
        opts = Options.from_dict({"num_sms": 8})
        from fusec.pipeline import Dumper
        artifacts.compile_graph(g, flat, opts, Dumper(None))
        art = artifacts.ArtifactCache.for_options(opts).load(artifacts.artifact_key(g, opts))
        named = {id(t): n for n, t in list(model.named_parameters()) + list(model.named_buffers())}
        read = [named.get(id(flat[g.inputs.index(n)]), n) for n in art["values"]]
        assert read, "no value recorded"
        assert all(any(s in n for s in small) for n in read), read
        if family == "llama":
            assert all("inv_freq" in n for n in read), read


def test_options_change_misses(cache_on, caplog):
    with caplog.at_level(logging.INFO, logger="fusec"):
        assert _decode(hf_tiny.llama(), {"num_sms": 8}, n=1) < 1e-4
        caplog.clear()
        assert _decode(hf_tiny.llama(), {"num_sms": 8, "attention_merge": "reduce"}, n=1) < 1e-4
        msgs = _messages(caplog)
        assert any(m.startswith("stage artifacts     miss") for m in msgs), msgs
        assert any(m.startswith("stage fuse") for m in msgs)
        caplog.clear()
        assert _decode(hf_tiny.llama(), {"num_sms": 12}, n=1) < 1e-4    # another SM count
        assert any(m.startswith("stage artifacts     miss") for m in _messages(caplog))
    assert len(list(_steps(cache_on))) == 3
    # options that do not change the schedule or the kernel share the entry
    base = Options.from_dict({"num_sms": 8})
    same = Options.from_dict({"num_sms": 8, "seed": 5, "check_hazards": False, "fallback": "eager",
                              "watchdog_s": 9.0, "mode": "reduce-overhead", "cache_max_mb": 7})
    assert artifacts.lowering_options(base) == artifacts.lowering_options(same)
    for change in ({"max_fusions": 3}, {"defines": {"FUSEC_LOADS_IN_FLIGHT": 4}}, {"profile": True}):
        assert artifacts.lowering_options(Options.from_dict({"num_sms": 8, **change})) != \
            artifacts.lowering_options(base), change


def test_damaged_entry_is_ignored_and_rewritten(cache_on, caplog):
    with caplog.at_level(logging.INFO, logger="fusec"):
        assert _decode(hf_tiny.llama(), {"num_sms": 8}, n=1) < 1e-4
        (entry,) = _steps(cache_on)
        data = entry.read_bytes()
        entry.write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
        caplog.clear()
        assert _decode(hf_tiny.llama(), {"num_sms": 8}, n=1) < 1e-4
        msgs = _messages(caplog)
        assert sum("ignoring unreadable entry" in m for m in msgs) == 1, msgs
        assert any(m.startswith("stage fuse") for m in msgs)
        assert any(m.startswith("stage artifacts     stored") for m in msgs)
        caplog.clear()
        assert _decode(hf_tiny.llama(), {"num_sms": 8}, n=1) < 1e-4
        assert any(m.startswith("stage artifacts     hit") for m in _messages(caplog))


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty", "other_key", "not_a_dict"])
def test_damaged_entries_load_as_misses(tmp_path, caplog, damage):
    cache = artifacts.ArtifactCache(tmp_path / "a", max_bytes=1 << 30)
    key = "c" * 64
    assert cache.store(key, _tiny_entry(key, 1000))
    assert cache.load(key) is not None
    data = cache.path(key).read_bytes()
    cache.path(key).write_bytes({
        "truncate": lambda: data[: len(data) // 2],
        "flip": lambda: data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:],
        "garbage": lambda: b"not an artifact at all",
        "empty": lambda: b"",
        "other_key": lambda: artifacts.dumps(_tiny_entry("d" * 64, 10)),
        "not_a_dict": lambda: artifacts.dumps([1, 2, 3]),
    }[damage]())
    with caplog.at_level(logging.INFO, logger="fusec"):
        assert cache.load(key) is None
    assert sum("ignoring unreadable entry" in r.getMessage() for r in caplog.records) == 1
    assert cache.store(key, _tiny_entry(key, 1000)) and cache.load(key) is not None


def test_cache_off_writes_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FUSEC_CACHE", "0")
    with caplog.at_level(logging.INFO, logger="fusec"):
        assert _decode(hf_tiny.llama(), {"num_sms": 8}, n=1) < 1e-4
        monkeypatch.setenv("FUSEC_CACHE", "1")
        assert _decode(hf_tiny.llama(), {"num_sms": 8, "cache": False}, n=1) < 1e-4
    assert not (tmp_path / "cache" / "artifacts").exists()
    assert not any("artifacts" in m for m in _messages(caplog))
    assert Options.from_dict({}).cache is True
    monkeypatch.setenv("FUSEC_CACHE", "maybe")
    with pytest.raises(FusecError, match="FUSEC_CACHE='maybe'"):
        Options.from_dict({})
    monkeypatch.setenv("FUSEC_CACHE", "1")
    monkeypatch.setenv("FUSEC_CACHE_MAX_MB", "12")
    assert Options.from_dict({}).cache_max_mb == 12
    with pytest.raises(FusecError):
        Options.from_dict({"cache": "yes"})


def test_dump_dir_runs_every_stage(cache_on, tmp_path, caplog):
    """FUSEC_DUMP / dump_dir: the cache is not read, every stage runs and is dumped."""
    assert _decode(hf_tiny.llama(), {"num_sms": 8}, n=1) < 1e-4
    with caplog.at_level(logging.INFO, logger="fusec"):
        assert _decode(hf_tiny.llama(), {"num_sms": 8, "dump_dir": str(tmp_path / "dump")}, n=1) < 1e-4
    msgs = _messages(caplog)
    assert any("not read (dump_dir is set" in m for m in msgs) and any(m.startswith("stage fuse") for m in msgs)
    names = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert any(n.endswith("_fuse.txt") for n in names) and "schedule.json" in names


def _tiny_entry(key: str, pad: int) -> dict:
    g = Graph()
    return {"format": artifacts.FORMAT, "key": key, "schedule": Schedule(1, [], [[]], g), "plan": None,
            "values": {}, "pad": b"x" * pad}


def test_lru_cap_evicts_least_recently_used(tmp_path, caplog):
    cache = artifacts.ArtifactCache(tmp_path / "a", max_bytes=250_000)
    keys = [f"{i:064x}" for i in range(4)]
    for i, k in enumerate(keys[:3]):
        assert cache.store(k, _tiny_entry(k, 70_000))
        os.utime(cache.path(k), (1000 + i, 1000 + i))     # k0 oldest ... k2 newest
    assert cache.load(keys[0]) is not None                  # a hit makes k0 the newest
    with caplog.at_level(logging.INFO, logger="fusec"):
        assert cache.store(keys[3], _tiny_entry(keys[3], 70_000))   # 4 x 70 kB > 250 kB: one goes
    left = {p.stem for p in (tmp_path / "a").glob("*.art")}
    assert left == {keys[0], keys[2], keys[3]}
    assert any("removed 1 least recently used entry" in r.getMessage() for r in caplog.records)
    assert sum(p.stat().st_size for p in (tmp_path / "a").glob("*.art")) <= 250_000
    # an entry larger than the whole cap is not stored at all
    assert cache.store("f" * 64, _tiny_entry("f" * 64, 300_000)) is None
    assert not cache.path("f" * 64).exists()
    # a temp file a killed writer left behind goes when it is old
    stale = tmp_path / "a" / ".0123.x.tmp"
    stale.write_bytes(b"partial")
    os.utime(stale, (1, 1))
    cache.evict()
    assert not stale.exists()


def test_concurrent_writers_and_readers_see_whole_entries(tmp_path):
    cache = artifacts.ArtifactCache(tmp_path / "a", max_bytes=1 << 30)
    key = "a" * 64
    bad: list[str] = []
    stop = time.time() + 2.0

    def write(pad: int) -> None:
        while time.time() < stop:
            cache.store(key, _tiny_entry(key, pad))

    def read() -> None:
        while time.time() < stop:
            art = cache.load(key)
            if art is not None and len(art["pad"]) not in (1000, 200_000):
                bad.append(str(len(art["pad"])))

    threads = [threading.Thread(target=write, args=(n,)) for n in (1000, 200_000)]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    assert [p.name for p in (tmp_path / "a").iterdir()] == [f"{key}.art"]   # no temp file left


FAMILIES = ["llama", "qwen3", "qwen2_bias", "gemma", "phi3_fused", "gpt_neox", "olmo2", "granite"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_round_trips(cache_on, family, monkeypatch):
    """Each family's entry loads back to the same schedule and kernel source, and the loaded
    schedule computes the step as the captured graph does."""
    from fusec import pipeline
    from fusec.cuda.codegen import render
    from fusec.pipeline import Dumper
    from fusec.sim import Simulator
    _, (aten_gm, g, flat) = _captured_family(family)
    opts = Options.from_dict({"num_sms": 8})
    monkeypatch.setattr(pipeline, "nvrtc_started", lambda plan: None)   # the entry, not the CUBIN
    made = artifacts.compile_graph(g, flat, opts, Dumper(None), target="cuda")
    fresh, plan = made.schedule, made.plan
    key = artifacts.artifact_key(g, opts)
    assert artifacts.artifact_key(g.copy(), opts) == key
    art = artifacts.ArtifactCache.for_options(opts).load(key)
    assert art is not None and art["plan"] is not None
    loaded = art["schedule"]
    assert json.dumps(loaded.to_json(), sort_keys=True) == json.dumps(fresh.to_json(), sort_keys=True)
    assert art["plan"] == plan
    assert render(loaded).source == plan.source
    for t in fresh.graph.tensors.values():
        if t.value is not None:
            assert torch.equal(loaded.graph.tensors[t.name].value, t.value), t.name
    with torch.no_grad():
        mut = {i for i, n in enumerate(g.inputs) if g.tensors[n].role.value in ("kv_cache", "state")}
        a_in = [x.clone() if i in mut else x for i, x in enumerate(flat)]
        b_in = [x.clone() if i in mut else x for i, x in enumerate(flat)]
        ref = aten_gm(*a_in)
        out = Simulator(loaded).step(b_in)
    ref = ref if isinstance(ref, (list, tuple)) else [ref]
    for a, b in zip(out, ref):
        if b.dtype.is_floating_point:
            assert ((a - b).norm() / b.norm().clamp_min(1e-12)).item() < 1e-4
        else:
            assert torch.equal(a.reshape(b.shape), b)


def test_cli_reuses_the_simulator_entry_and_its_kernel(cache_on, tmp_path, capsys):
    """``fusec compile``: a compile without --emit-cuda stores the schedule; --emit-cuda then hits,
    renders once and stores the kernel source with it; the next --emit-cuda renders nothing and
    finds the CUBIN in NVRTC's cache: the same kernel.cu."""
    from fusec.cli import main
    example = str(ROOT / "examples" / "tiny_llama.py")
    errs, kernels = [], []
    for i, flags in enumerate(([], ["--emit-cuda"], ["--emit-cuda"])):
        out = tmp_path / f"out{i}"
        assert main(["compile", example, "-o", str(out), "--num-sms", "8", *flags]) == 0
        errs.append(capsys.readouterr().err)
        if flags:
            kernels.append((out / "kernel.cu").read_text())
    assert "stage artifacts     miss" in errs[0] and "stage fuse" in errs[0]
    assert "stage artifacts     hit" in errs[1] and "no kernel source" in errs[1]
    assert "stage render" in errs[1] and "stage fuse" not in errs[1]
    assert "stage artifacts     hit" in errs[2] and "stage render" not in errs[2]
    assert ", cached)" in errs[2].split("stage nvrtc")[1].splitlines()[0]
    assert kernels[0] == kernels[1]
    assert len(list(_steps(cache_on))) == 1


def test_graph_made_constant_is_stored_from_the_backend(cache_on, caplog):
    """Falcon's ATen graph holds a tensor constant: the backend stores the entry while AOT
    autograd's fake mode is on, so the constant is read outside that mode; the entry is stored and
    a second compile of the same step hits it."""
    model = hf_tiny.falcon()
    cache = hf_tiny.static_cache(model, 32)
    tok = torch.tensor([[5]])
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)
        with caplog.at_level(logging.INFO, logger="fusec"):
            for _ in range(2):
                torch._dynamo.reset()
                torch.compile(model, backend="fusec", options={"num_sms": 8})(
                    input_ids=tok, past_key_values=cache, use_cache=True)
    torch._dynamo.reset()
    text = [r.getMessage() for r in caplog.records]
    assert not [t for t in text if "not stored" in t], text
    assert [t for t in text if "warm start" in t or ("artifacts" in t and " hit " in t)], text


def test_entry_tensors_are_safetensors(cache_on):
    """An entry's tensors (the graph's constants: RoPE tables) are a safetensors blob inside
    the file, and the JSON beside it only refers to them."""
    from safetensors.torch import load
    from fusec.pipeline import Dumper
    _, (_, g, flat) = _captured_family("llama")
    opts = Options.from_dict({"num_sms": 8})
    fresh = artifacts.compile_graph(g, flat, opts, Dumper(None)).schedule
    data = artifacts.ArtifactCache.for_options(opts).path(artifacts.artifact_key(g, opts)).read_bytes()
    n = len(artifacts.MAGIC) + 32
    size = int.from_bytes(data[n:n + 8], "little")
    tensors = load(data[n + 8:n + 8 + size])
    consts = [t.value for t in fresh.graph.tensors.values() if t.value is not None and t.value.numel() > 1]
    assert consts and tensors
    for c in consts:
        assert any(t.shape == c.shape and t.dtype == c.dtype and torch.equal(t, c.cpu()) for t in tensors.values())
    assert b"torch._utils\n_rebuild" not in data and b"_rebuild_tensor" not in data
