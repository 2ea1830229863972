"""Every option's type and range is checked when the options are read (issue 30, items 5 and 6a):
a FusecError naming the option, its value and what it must be, before any work."""
from __future__ import annotations

import dataclasses
import os

import pytest

from fusec.config import MAX_NUM_SMS, Options, _RULES
from fusec.errors import FusecError

#: option -> values that must be refused (each once alone, over the defaults)
BAD = {
    "target": ["gpu", 1, ["sim"]],
    "num_sms": [0, -1, MAX_NUM_SMS + 1, 10 ** 8, 2.0, "8", True],
    "dump_dir": [3, ["d"]],
    "fallback": ["aot_eager", None, 0],
    "seed": [1.5, "0", None, False],
    "check_hazards": ["no", "False", 0, 1, None],
    "max_fusions": [-5, -1, 1.0, "3", True],
    "bandwidth": ["fast", 0, -1e12, float("inf"), float("nan"), None, True],
    "watchdog_s": [0, -2.0, float("inf"), float("nan"), "2", 1e10, False],
    "check_watchdog": ["yes", 1, None],
    "profile": ["on", 1],
    "profile_dir": [1, ["p"]],
    "profile_step": [0, -3, 2.0, "3", None],
    "attention_merge": ["tree", None, 1],
    "mode": ["fast", 1, ["default"], {"a": 1}],
    "cache": ["yes", 1, None],
    "cache_max_mb": [-1, 1.5, "10", None],
    "max_cache_len": [0, -64, (1 << 20) + 1, 64.0, "64"],
    "position_rows": [0, -64, (1 << 20) + 1, 64.0, "64"],
}
#: option -> values that must be accepted, and what they become
GOOD = {
    "num_sms": [(1, 1), (132, 132), (MAX_NUM_SMS, MAX_NUM_SMS), (None, None)],
    "max_fusions": [(0, 0), (7, 7), (None, None)],
    "bandwidth": [(4.3e12, 4.3e12), (10 ** 12, 1e12)],
    "watchdog_s": [(0.25, 0.25), (5, 5.0)],
    "seed": [(0, 0), (-3, -3), (2 ** 40, 2 ** 40)],
    "check_hazards": [(False, False)],
    "mode": [(None, None), ("reduce-overhead", "reduce-overhead")],
    "target": [(None, None), ("sim", "sim")],
    "max_cache_len": [(1, 1), (4096, 4096), (None, None)],
    "position_rows": [(1, 1), (32768, 32768), (None, None)],
}


def test_every_option_but_defines_has_a_rule():
    """A new option must come with its check (defines have their own, in from_dict)."""
    assert set(_RULES) == {f.name for f in dataclasses.fields(Options)} - {"defines"}


@pytest.mark.parametrize("key,value", [(k, v) for k, vs in BAD.items() for v in vs],
                         ids=lambda x: repr(x)[:20])
def test_bad_value_is_a_clear_error(key, value):
    with pytest.raises(FusecError) as e:
        Options.from_dict({key: value})
    msg = str(e.value)
    assert f"option {key}={value!r}" in msg and "must be" in msg, msg


@pytest.mark.parametrize("key,value,want", [(k, v, w) for k, vs in GOOD.items() for v, w in vs])
def test_good_value_is_kept(key, value, want):
    got = getattr(Options.from_dict({key: value}), key)
    assert got == want and type(got) is type(want)


def test_messages_say_what_the_value_must_be():
    with pytest.raises(FusecError, match=rf"num_sms=100000000 must be an int in \[1, {MAX_NUM_SMS}\]"):
        Options.from_dict({"num_sms": 10 ** 8})
    with pytest.raises(FusecError, match=r"check_hazards='no' must be True or False"):
        Options.from_dict({"check_hazards": "no"})
    with pytest.raises(FusecError, match=r"bandwidth='fast' must be a finite number > 0"):
        Options.from_dict({"bandwidth": "fast"})
    with pytest.raises(FusecError, match=r"max_fusions=-5 must be an int >= 0"):
        Options.from_dict({"max_fusions": -5})
    with pytest.raises(FusecError, match=r"watchdog_s=0 must be a finite number > 0"):
        Options.from_dict({"watchdog_s": 0})
    with pytest.raises(FusecError, match=r"seed=1.5 must be an int"):
        Options.from_dict({"seed": 1.5})


def test_environment_values_are_checked_and_named(monkeypatch):
    monkeypatch.setenv("FUSEC_NUM_SMS", str(MAX_NUM_SMS + 1))
    with pytest.raises(FusecError, match=r"num_sms=1025 \(from FUSEC_NUM_SMS\) must be an int in"):
        Options.from_dict({})
    assert Options.from_dict({"num_sms": 8}).num_sms == 8   # the option wins over the variable
    monkeypatch.setenv("FUSEC_NUM_SMS", "0")
    with pytest.raises(FusecError, match="FUSEC_NUM_SMS"):
        Options.from_dict({})


# ---- dump_dir (issue 30, item 6a) ----

def test_dump_dir_under_a_file_is_an_error_naming_it(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    for bad in (f, f / "dump"):
        with pytest.raises(FusecError) as e:
            Options.from_dict({"dump_dir": str(bad)})
        msg = str(e.value)
        assert f"dump_dir={str(bad)!r}" in msg and "Error" in msg, msg   # the OS error's type


def test_dump_dir_from_the_environment_is_named(tmp_path, monkeypatch):
    f = tmp_path / "a_file"
    f.write_text("x")
    monkeypatch.setenv("FUSEC_DUMP", str(f / "d"))
    with pytest.raises(FusecError, match=r"dump_dir=.* \(from FUSEC_DUMP\) is not a folder fusec can write"):
        Options.from_dict({})


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_dump_dir_is_an_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(FusecError, match="PermissionError"):
            Options.from_dict({"dump_dir": str(ro / "dump")})
    finally:
        ro.chmod(0o700)


def test_writable_dump_dir_is_created(tmp_path):
    d = tmp_path / "x" / "dump"
    assert Options.from_dict({"dump_dir": str(d)}).dump_dir == str(d)
    assert d.is_dir() and not list(d.iterdir())   # the probe file is gone


def test_torch_compile_with_an_unwritable_dump_dir_says_so(tmp_path):
    """Before: "capturing the graph to ATen failed", and inductor ran the step."""
    import torch
    import hf_tiny
    from fusec.fallbacks import FallbackWatch
    f = tmp_path / "a_file"
    f.write_text("x")
    model = hf_tiny.llama(layers=1)
    cache = hf_tiny.static_cache(model, 16)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusec", options={"target": "sim", "dump_dir": str(f / "d")})
    with torch.no_grad(), FallbackWatch() as w:
        model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)
        with pytest.raises(Exception, match=r"dump_dir=.*NotADirectoryError") as e:
            compiled(input_ids=torch.tensor([[4]]), past_key_values=cache, use_cache=True)
    torch._dynamo.reset()
    assert "FusecError" in str(e.value) and not w.fallbacks


def test_dumper_write_failure_names_dump_dir(tmp_path):
    """A folder that stops taking files after the check (removed, replaced by a file): the
    Dumper's FusecError names dump_dir, the file and the OS error."""
    import shutil
    from fusec.pipeline import Dumper
    d = tmp_path / "dump"
    dump = Dumper(str(d))
    dump.text("a.txt", "x")
    shutil.rmtree(d)
    d.write_text("now a file")
    with pytest.raises(FusecError, match=r"dump_dir: cannot write .*01_b.txt.*Error"):
        dump.text("b.txt", "y")
    with pytest.raises(FusecError, match=r"dump_dir: cannot write .*Error"):
        Dumper(str(d / "sub"))


def test_every_option_declares_whether_it_changes_lowering():
    """The artifact key takes exactly the options declared as changing lowering (issue 30 item 9):
    a field added without the declaration is refused when fusec.config is imported."""
    import dataclasses

    import pytest as _pytest

    from fusec import config
    fields = dataclasses.fields(config.Options)
    assert all("lowering" in f.metadata for f in fields)
    key = config.lowering_options(config.Options.from_dict({"num_sms": 8}))
    assert set(key) == {f.name for f in fields if f.metadata["lowering"] is not None}
    assert set(key) == {"num_sms", "max_fusions", "attention_merge", "chain", "prologue", "profile", "defines",
                        "position_rows"}
    assert config.lowering_options(config.Options.from_dict({}))["num_sms"] == 132

    # a class like Options with one undeclared field is refused (the check runs on Options at import)
    @dataclasses.dataclass
    class Bad:
        a: int = config._opt(1)
        b: int = 2
    with _pytest.raises(TypeError, match=r"\['b'\] do not declare"):
        config.check_declared(Bad)
    config.check_declared(config.Options)
