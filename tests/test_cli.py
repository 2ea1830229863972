"""The ``fusec`` CLI's error paths, and the tiny example model file it is meant to load.

The error paths all fail before the compiler is imported, so these tests need no compiler.
"""
from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusec.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_missing_file(tmp_path, capsys):
    missing = tmp_path / "no_such_model.py"
    code, err = _run(capsys, "compile", str(missing))
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("fusec: error:")
    assert "no_such_model.py" in err and "does not exist" in err
    assert "Traceback" not in err


def test_file_without_build(tmp_path, capsys):
    f = tmp_path / "nobuild.py"
    f.write_text("x = 1\n")
    code, err = _run(capsys, "compile", str(f))
    assert code == 2
    assert "no build() function" in err and "nobuild.py" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "body, what",
    [
        ("return 'not a model'", "build() returned str"),
        ("return (1, 2, 3, 4)", "tuple of length 4"),
        ("return (42, ())", "returned a int as model"),
        ("return (torch.nn.Linear(2, 2), 'x')", "returned a str as args"),
        ("return (torch.nn.Linear(2, 2), (), [])", "returned a list as kwargs"),
    ],
)
def test_build_returns_wrong_shape(tmp_path, capsys, body, what):
    f = tmp_path / "wrong.py"
    f.write_text(f"import torch\n\ndef build():\n    {body}\n")
    code, err = _run(capsys, "compile", str(f))
    assert code == 2
    assert what in err
    assert "expected (model, args) or (model, args, kwargs)" in err
    assert len(err.strip().splitlines()) <= 2  # the 'loading' stage line and the error


def test_model_file_can_import_beside_itself(tmp_path, capsys):
    (tmp_path / "helper_beside.py").write_text("VALUE = 'str'\n")
    f = tmp_path / "uses_helper.py"
    f.write_text("import helper_beside\n\ndef build():\n    return helper_beside.VALUE\n")
    code, err = _run(capsys, "compile", str(f))
    assert code == 2 and "build() returned str" in err
    assert str(tmp_path) not in sys.path


def test_module_entry_point_exit_code(tmp_path):
    missing = tmp_path / "gone.py"
    proc = subprocess.run(
        [sys.executable, "-m", "fusec", "compile", str(missing)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 2
    assert "gone.py" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_tiny_llama_example_builds_one_decode_step():
    model, args, kwargs = runpy.run_path(str(ROOT / "examples" / "tiny_llama.py"))["build"]()
    assert isinstance(model, torch.nn.Module)
    assert isinstance(args, tuple) and isinstance(kwargs, dict)
    assert kwargs["input_ids"].shape == (1, 1)
    cache = kwargs["past_key_values"]
    assert int(cache.get_seq_length()) == 5  # the prefill is in the cache
    with torch.no_grad():
        out = model(*args, **kwargs)
    assert out.logits.shape == (1, 1, 300)
    assert out.logits.dtype == torch.float32
    assert torch.isfinite(out.logits).all()


def test_main_restores_logging_state(tmp_path, capsys):
    import logging

    logger = logging.getLogger("fusec")
    before = (list(logger.handlers), logger.level, logger.propagate)
    main(["compile", str(tmp_path / "missing.py")])
    assert (list(logger.handlers), logger.level, logger.propagate) == before


def test_model_file_errors_are_one_line(tmp_path, capsys):
    from fusec.cli import main
    bad = tmp_path / "syntax.py"
    bad.write_text("def build(:\n")
    assert main(["compile", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "syntax error" in err and "Traceback" not in err
    boom = tmp_path / "boom.py"
    boom.write_text("def build():\n    raise RuntimeError('boom')\n")
    assert main(["compile", str(boom)]) == 2
    err = capsys.readouterr().err
    assert "build() failed: RuntimeError: boom (at boom.py:2)" in err and "Traceback" not in err


def test_emit_cuda_writes_kernel_and_resource_report(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from fusec.cli import main
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    example = Path(__file__).resolve().parent.parent / "examples" / "tiny_llama.py"
    out = tmp_path / "out"
    assert main(["compile", str(example), "-o", str(out), "--num-sms", "8", "--emit-cuda"]) == 0
    src = (out / "kernel.cu").read_text()
    assert 'extern "C" __global__ void __launch_bounds__(512, 1)' in src and "rms_qkv_rope<" in src
    assert (out / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"
    report = capsys.readouterr().out
    assert "kernel fusec_step (sm_90a" in report and "0 B spill stores" in report
    # a later compile into the same folder without --emit-cuda leaves no mismatched kernel
    assert main(["compile", str(example), "-o", str(out), "--num-sms", "4"]) == 0
    assert (out / "schedule.json").is_file()
    assert not (out / "kernel.cu").exists() and not (out / "kernel.cubin").exists()


def test_env_options_reach_the_cli(tmp_path, capsys, monkeypatch):
    """FUSEC_NUM_SMS is the default of --num-sms; FUSEC_DEFINES reaches --emit-cuda's kernel; a
    bad integer in the environment is a one-line error naming the variable."""
    import json
    example = ROOT / "examples" / "tiny_llama.py"
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FUSEC_NUM_SMS", "6")
    monkeypatch.setenv("FUSEC_DEFINES", "FUSEC_LOADS_IN_FLIGHT=4")
    out = tmp_path / "out"
    assert main(["compile", str(example), "-o", str(out), "--emit-cuda"]) == 0
    assert json.loads((out / "schedule.json").read_text())["num_sms"] == 6
    assert "#define FUSEC_LOADS_IN_FLIGHT 4" in (out / "kernel.cu").read_text()
    assert main(["compile", str(example), "-o", str(out), "--num-sms", "3"]) == 0   # the flag wins
    assert json.loads((out / "schedule.json").read_text())["num_sms"] == 3
    capsys.readouterr()
    monkeypatch.setenv("FUSEC_NUM_SMS", "abc")
    code, err = _run(capsys, "compile", str(example), "-o", str(out))
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "fusec: error: FUSEC_NUM_SMS='abc': expected an integer >= 1"


def test_timeline_command_errors_and_output(tmp_path, capsys):
    code, err = _run(capsys, "timeline", str(tmp_path / "missing.json"))
    assert code == 2 and "no such timeline file" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    code, err = _run(capsys, "timeline", str(bad))
    assert code == 2 and "bad.json" in err
    pytest.importorskip("matplotlib")
    from test_profile import _random   # a small fake recorded step
    from fusec.runtime.profile import Timeline
    sched, records = _random()
    src = tmp_path / "timeline.json"
    Timeline.from_records(records, sched).save(src)
    code = main(["timeline", str(src), "-o", str(tmp_path / "t.png")])
    out = capsys.readouterr().out
    assert code == 0 and (tmp_path / "t.png").stat().st_size > 1000
    assert "instructions on" in out and "span" in out
    code = main(["timeline", str(src), "-o", str(tmp_path / "t.png"), "--layer", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "window" in out and "op4" in out and "op0" not in out
    code, err = _run(capsys, "timeline", str(src), "-o", str(tmp_path / "t99.png"), "--layer", "99")
    assert code == 2 and "no instructions in layer 99" in err
    assert not (tmp_path / "t99.png").exists()           # nothing written on a bad layer


def _simulate_tiny(tmp_path, capsys, *extra: str) -> tuple[int, str, str]:
    code = main(["compile", str(ROOT / "examples" / "tiny_llama.py"), "-o", str(tmp_path / "out"),
                 "--num-sms", "8", "--simulate", *extra])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_simulate_is_numeric_against_eager(tmp_path, capsys):
    """--simulate on a small model compares the logits and every written KV cache and counter
    with eager execution of the same step, and says so with the measured error."""
    import re
    code, out, err = _simulate_tiny(tmp_path, capsys)
    assert code == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("simulator:"))
    m = re.search(r"one step numeric: 1 output and (\d+) written buffers match eager "
                  r"\(max rel err (\S+), tolerance 0.0001\); no deadlock, no hazard", line)
    assert m, line
    assert int(m.group(1)) == 6                      # 2 layers x (K, V, position counter)
    assert 0 < float(m.group(2)) < 1e-4              # 0 would mean nothing was computed


def test_simulate_fails_on_corrupted_output(tmp_path, capsys, monkeypatch):
    """An instruction kind whose simulated semantics are off by 1.0 is a one-line error naming
    the graph output, its role, shape and dtype, and exit status 2."""
    from fusec.instructions.matvec_residual import MatvecResidual
    real = MatvecResidual.run_tile.__func__

    def corrupted(cls, op, tile, env):
        real(cls, op, tile, env)
        r0, r1 = tile.params["rows"]
        env.flat(op.outputs["out"])[r0:r1] += 1.0
    monkeypatch.setattr(MatvecResidual, "run_tile", classmethod(corrupted))
    code, out, err = _simulate_tiny(tmp_path, capsys)
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("fusec: error: simulator disagrees with eager: output 0 ")
    assert "(output, float32[1,1,300])" in last and "relative error" in last
    assert "no deadlock" not in out


def test_simulate_fails_on_corrupted_kv_write(tmp_path, capsys, monkeypatch):
    """A stray write into a KV cache row the step does not read (so the logits are right) is
    caught through the written buffers, and the error names the cache."""
    from fusec.instructions.rms_qkv_rope import RmsQkvRope
    real = RmsQkvRope.run_tile.__func__

    def corrupted(cls, op, tile, env):
        real(cls, op, tile, env)
        if "vcache" in op.outputs:
            kv_pos = int(env.read(op.inputs["kv_pos"]).reshape(-1)[0])
            env.read(op.outputs["vcache"])[:, :, kv_pos + 1] = 1.0
    monkeypatch.setattr(RmsQkvRope, "run_tile", classmethod(corrupted))
    code, out, err = _simulate_tiny(tmp_path, capsys)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert "simulator disagrees with eager: written buffer " in last
    assert "(kv_cache, float32[1,2,64,16])" in last and "elements either run wrote" in last


def test_simulate_structure_only_over_the_limit(tmp_path, capsys, monkeypatch):
    """Over the numeric limit (--numeric-limit-mib) the summary says plainly that values were
    not compared."""
    code, out, err = _simulate_tiny(tmp_path, capsys, "--numeric-limit-mib", str(1024 / (1 << 20)))
    assert code == 0, err
    import re
    assert re.search(r"simulator: one step structure only: the model has [0-9.]+ MiB of weights, over "
                     r"the 0.00098 MiB numeric limit \(--numeric-limit-mib\); values were not compared; "
                     r"no deadlock, no hazard",
                     out), out


def test_run_without_cuda_is_skipped(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["compile", str(ROOT / "examples" / "tiny_llama.py"), "-o", str(tmp_path / "out"),
                 "--num-sms", "4", "--run"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[-1] == "no CUDA device: --run skipped"
    assert "fused ops by kind:" in out          # the rest is done as without --run


def test_run_step_timing_on_the_simulator(capsys):
    """--run's code path (build on the device, compile with the fusec backend, time fusec and
    eager from the same KV state), here on the CPU with the simulator as the target."""
    import re

    from fusec.cli import run_step_timing
    run_step_timing(ROOT / "examples" / "tiny_llama.py", "cpu", steps=2, warmup=1,
                    options={"target": "sim", "num_sms": 8})
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"fusec step: (\S+) ms \(median of 2 at KV positions 5\.\.6\), eager: (\S+) ms, "
                     r"speed-up (\S+) x; first step's output vs eager: rel err (\S+)", line)
    assert m, line
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0
    assert 0 < float(m.group(4)) < 1e-4          # 0 would mean eager was timed twice


def test_time_decode_restores_the_state():
    from fusec.runtime.timing import time_decode
    model, args, kwargs = runpy.run_path(str(ROOT / "examples" / "tiny_llama.py"))["build"]()
    cache = kwargs["past_key_values"]
    before = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]
    t = time_decode(model, args, kwargs, steps=2, warmup=1, options={"target": "sim", "num_sms": 4})
    assert len(t.fusec_ms) == len(t.eager_ms) == 2 and not t.fallbacks and t.position == 5
    assert int(cache.get_seq_length()) == 5
    after = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_run_fails_loudly_on_a_fallback(monkeypatch):
    """A step that fusec hands to another backend is an error, never a timing of that backend."""
    import fusec.frontend.backend
    from fusec.cli import run_step_timing
    from fusec.errors import FusecError, NotDecodeStepError

    def refuse(gm, query_tokens=1):
        raise NotDecodeStepError("refused by the test")
    monkeypatch.setattr(fusec.frontend.backend, "check_decode_step", refuse)
    with pytest.raises(FusecError, match="FUSEC FELL BACK.*refused by the test"):
        run_step_timing(ROOT / "examples" / "tiny_llama.py", "cpu", steps=1, warmup=0,
                        options={"target": "sim", "fallback": "eager"})


def test_run_needs_build_with_device(tmp_path):
    from fusec.cli import run_step_timing
    from fusec.errors import ModelFileError
    f = tmp_path / "nodevice.py"
    f.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(2, 2), ()\n")
    with pytest.raises(ModelFileError, match="build\\(\\) takes no device argument"):
        run_step_timing(f, "cpu", steps=1, warmup=0)


def test_flag_mistakes_name_the_subcommand(tmp_path, capsys, monkeypatch):
    """A misspelt flag gets the compile subcommand's usage (not the top-level one); --run-steps
    without --run is an error instead of doing nothing; a bad FUSEC_* environment value fails
    before the model file's build() runs; --numeric-limit-mib without --simulate is an error
    too (found by new-user trials)."""
    example = ROOT / "examples" / "tiny_llama.py"
    with pytest.raises(SystemExit) as e:
        main(["compile", str(example), "--emit-cude"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: fusec compile" in err and "unrecognized arguments: --emit-cude" in err
    with pytest.raises(SystemExit) as e:
        main(["compile", str(example), "--run-steps", "5"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--run-steps needs --run" in err
    with pytest.raises(SystemExit) as e:   # it did nothing without --simulate, silently
        main(["compile", str(example), "--numeric-limit-mib", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--numeric-limit-mib needs --simulate" in err
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["-v", "compile", str(example), "-o", str(tmp_path / "o1")]) == 0   # -v before the command
    capsys.readouterr()
    marker = tmp_path / "built"
    model_py = tmp_path / "m.py"
    model_py.write_text(f"def build():\n    open({str(marker)!r}, 'w').close()\n    raise SystemExit('not reached')\n")
    monkeypatch.setenv("FUSEC_ATTENTION_MERGE", "nope")
    code, err = _run(capsys, "compile", str(model_py), "-o", str(tmp_path / "out"))
    assert code == 2 and "FUSEC_ATTENTION_MERGE" in err and "Traceback" not in err
    assert not marker.exists(), "build() ran before the environment was checked"


def test_log_lines_carry_one_prefix():
    """The CLI's stderr lines start with one ``fusec: ``, also for messages that begin with it."""
    import logging

    from fusec.cli import _Prefixed

    def line(msg):
        return _Prefixed().format(logging.LogRecord("fusec", logging.INFO, __file__, 1, msg, (), None))
    assert line("fusec: running this graph eagerly: x") == "fusec: running this graph eagerly: x"
    assert line("compiled 3 ops") == "fusec: compiled 3 ops"


@pytest.mark.parametrize("where", ["import", "build"])
def test_model_file_calling_sys_exit_is_an_error(tmp_path, capsys, where):
    """sys.exit(0) in the model file (at import, or in build()) made `fusec compile` exit 0 and
    write nothing; now it is an error naming the file."""
    f = tmp_path / "exits.py"
    body = "import sys\nsys.exit(0)\n" if where == "import" else "import sys\n\ndef build():\n    sys.exit(0)\n"
    f.write_text(body)
    out = tmp_path / "out"
    code, err = _run(capsys, "compile", str(f), "-o", str(out))
    assert code == 2
    assert "exits.py" in err and "sys.exit(0)" in err and "exits.py:" in err   # file and line
    assert "Traceback" not in err and not out.exists()


def _marker_model(tmp_path) -> tuple[Path, Path]:
    """A model file whose build() leaves a marker file (then fails): whether build() ran."""
    marker = tmp_path / "build_ran"
    f = tmp_path / "marks.py"
    f.write_text(f"def build():\n    open({str(marker)!r}, 'w').close()\n    return 'no model'\n")
    return f, marker


@pytest.mark.parametrize("how", ["file", "under_file"])
def test_out_dir_that_cannot_be_a_folder_fails_before_build(tmp_path, capsys, how):
    """-o at an existing file was reported only after the whole compile."""
    f, marker = _marker_model(tmp_path)
    existing = tmp_path / "existing.txt"
    existing.write_text("keep me")
    out = existing if how == "file" else existing / "sub"
    code, err = _run(capsys, "compile", str(f), "-o", str(out))
    assert code == 2 and "output folder" in err and str(out) in err
    assert ("is an existing file" if how == "file" else "is a file") in err
    assert not marker.exists() and existing.read_text() == "keep me"


def test_num_sms_out_of_range_fails_before_build(tmp_path, capsys):
    f, marker = _marker_model(tmp_path)
    code, err = _run(capsys, "compile", str(f), "--num-sms", "100000000", "-o", str(tmp_path / "o"))
    assert code == 2 and "num_sms=100000000 must be an int in [1, 1024]" in err
    assert not marker.exists()


def test_a_model_that_fails_in_dynamo_names_the_root_cause_and_the_line(tmp_path, capsys):
    """Arguments the model cannot take (floats where input ids go): dynamo's first line is
    generic ("RuntimeError when making fake tensor call"); the CLI's one line also gives the
    root cause and the model's line that raised it."""
    f = tmp_path / "badargs.py"
    f.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\nimport torch, hf_tiny\n\n"
                 "def build():\n    return hf_tiny.llama(), (torch.randn(1, 1, 64),)\n")
    code, err = _run(capsys, "compile", str(f), "-o", str(tmp_path / "out"))
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("fusec: error: could not capture the model as one graph"), err
    assert "caused by RuntimeError: Expected tensor for argument #1 'indices'" in last, last
    assert "at modeling_llama.py:" in last and "self.embed_tokens(input_ids)" in last, last


def test_option_flag_compiles_a_k_token_step_and_checks_its_values(tmp_path, capsys):
    """``--option query_tokens=4`` compiles a step of 4 query tokens (without it: the fallback
    message that names the option); a bad name or value fails before build() with the option's
    own message; the flags' own options are refused with the flag to use."""
    f = tmp_path / "k4.py"
    f.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\nimport torch, hf_tiny\n\n"
                 "def build():\n    m = hf_tiny.llama()\n    cache = hf_tiny.static_cache(m, 32)\n"
                 "    with torch.no_grad():\n        m(input_ids=torch.randint(0, 128, (1, 5)), past_key_values=cache, use_cache=True)\n"
                 "    return m, (), {'input_ids': torch.randint(0, 128, (1, 4)), 'past_key_values': cache, 'use_cache': True}\n")
    code, err = _run(capsys, "compile", str(f), "-o", str(tmp_path / "a"))
    assert code == 2 and "option query_tokens=4" in err, err
    code, err = _run(capsys, "compile", str(f), "-o", str(tmp_path / "b"), "--option", "query_tokens=4",
                     "--option", "max_fusions=0")
    assert code == 0, err
    assert (tmp_path / "b" / "graph.txt").read_text().startswith("# batch 1, query tokens 4")
    code, err = _run(capsys, "compile", str(f), "--option", "query_tokens=99")
    assert code == 2 and "query_tokens" in err and "build() returned" not in err, err
    code, err = _run(capsys, "compile", str(f), "--option", "no_such_option=1")
    assert code == 2 and "unknown fusec option(s) ['no_such_option']" in err, err
    with pytest.raises(SystemExit):
        main(["compile", str(f), "--option", "emit_cuda=True"])
    assert "emit_cuda: set it with --emit-cuda" in capsys.readouterr().err


def test_summary_names_the_step_shape_and_a_query_tokens_bound_the_inputs_do_not_reach(tmp_path, capsys):
    """The summary's first line is the step's shape. ``--option query_tokens=4`` is the most
    query tokens a step takes, not a shape: on a model file whose build() passes one token the
    step has one, and the line says so and what to pass instead (it compiled a 1-token step
    silently before)."""
    example = str(ROOT / "examples" / "tiny_llama.py")
    assert main(["compile", example, "-o", str(tmp_path / "a")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "step: 1 sequence of 1 query token", first
    assert main(["compile", example, "-o", str(tmp_path / "b"), "--option", "query_tokens=4"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("step: 1 sequence of 1 query token (option query_tokens=4 is the most"), first
    assert "pass input_ids of 4 tokens for a 4-token step" in first, first


def test_compile_command_takes_a_dynamic_rope_model(tmp_path, capsys):
    """``fusec compile`` on a model file whose model uses dynamic NTK RoPE (HF's
    ``dynamic_rope_update`` branched on the position: a graph break, and the CLI failed before;
    issue 30, item 7), at a position past ``max_position_embeddings`` where the scaling is on:
    exit 0, the simulator's numeric check against eager, the kernel written by NVRTC."""
    f = tmp_path / "dyn_rope.py"
    f.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "import hf_tiny\n\n"
        "def build(device='cpu'):\n"
        "    model = hf_tiny.llama_dynamic_ntk(max_positions=16).to(device)\n"
        "    cache = hf_tiny.static_cache(model, 32)\n"
        "    with torch.no_grad():\n"
        "        model(input_ids=torch.randint(0, 128, (1, 18)), past_key_values=cache, use_cache=True)\n"
        "    return model, (), {'input_ids': torch.randint(0, 128, (1, 1)), 'past_key_values': cache,\n"
        "                       'use_cache': True}\n")
    out = tmp_path / "out"
    code = main(["compile", str(f), "-o", str(out), "--simulate", "--emit-cuda", "--num-sms", "8"])
    text = capsys.readouterr()
    assert code == 0, text.err
    import re
    err = re.search(r"max rel err ([0-9.e+-]+), tolerance", text.out + text.err)   # compared with eager
    assert err and float(err.group(1)) < 1e-4, text.out + text.err
    assert (out / "kernel.cu").exists() and (out / "kernel.cubin").exists()
