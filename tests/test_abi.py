"""The host-kernel layouts are written once (fusec/abi.py): the kernel's rendered ``#define``s,
``struct Instr`` and ``fusec_step``'s parameters agree with the Python tables, and no template
writes a layout's number (a fault code, a status word, a record field) instead of its name."""
from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from fusec import abi, template_dir

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny_llama.py"


@pytest.fixture(scope="module")
def sources():
    """The tiny example's kernel source, plain and profiling build: {profile: source}."""
    from fusec.api import compile_model
    from fusec.cuda.codegen import render
    model, args, kwargs = runpy.run_path(str(EXAMPLE))["build"]()
    s = compile_model(model, args, kwargs, {"num_sms": 8}).schedule
    return {p: render(s, profile=p).source for p in (False, True)}


def _expected() -> dict[str, int]:
    """Every ``#define`` the header must hold, from the tables."""
    want = {"FUSEC_WORD": abi.WORD, "FUSEC_ST_HEAD": abi.ST_HEAD, "FUSEC_WD_HEAD": abi.WD_HEAD,
            "FUSEC_WD_REC": abi.WD_REC, "FUSEC_PROF_FIELDS": len(abi.Prof)}
    for prefix, table in (("ST", abi.Status), ("WD", abi.WdRecord), ("CLAIM", abi.Claim),
                          ("FAULT", abi.Fault), ("PROF", abi.Prof)):
        want.update({f"FUSEC_{prefix}_{f.name}": int(f) for f in table})
    return want


#: a layout name of the header (not a knob such as FUSEC_STAGE_QUEUE)
_ABI_NAME = re.compile(r"\bFUSEC_(?:WORD\b|(?:ST|WD|CLAIM|FAULT|PROF)_\w+)")


def _defines(src: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define (FUSEC_\w+) (-?\d+)\b", src, re.M)}


def test_tables_are_consistent():
    """Each table numbers its fields 0, 1, ... in order (a word array's index), the codes are
    distinct, and every member says what it is."""
    for table in (abi.Word, abi.Status, abi.WdRecord, abi.Prof, abi.Claim):
        assert [int(f) for f in table] == list(range(len(table))), table
    assert len({int(f) for f in abi.Fault}) == len(abi.Fault) and 0 not in set(abi.Fault)   # 0: no fault
    assert len(abi.Status) <= abi.ST_HEAD and abi.WD_HEAD >= 1
    members = [f for t in (abi.Word, abi.Status, abi.WdRecord, abi.Claim, abi.Fault, abi.Prof) for f in t]
    assert all(len(f.doc) > 5 for f in members)
    names = [p.name for p in abi.kernel_params(True)]
    assert len(set(names)) == len(names) and names[-1] == abi.PROF_PARAM.name
    assert abi.kernel_params(False) == abi.PARAMS


@pytest.mark.parametrize("profile", [False, True])
def test_rendered_header_matches_the_tables(sources, profile):
    """The kernel's ``#define``s parsed back equal the tables, and it defines no layout name the
    tables do not have (a stale one)."""
    src = sources[profile]
    got = _defines(src)
    want = _expected()
    assert {k: got.get(k) for k in want} == want
    stale = {k for k in got if _ABI_NAME.fullmatch(k)} - set(want)
    assert not stale, stale
    assert got.get("FUSEC_MARKS") == (abi.PROF_MARKS if profile else None)
    # the header comes before common.cuh, whose status reports use it
    assert src.index("#define FUSEC_ST_HEAD") < src.index("fusec_report_fault(")


@pytest.mark.parametrize("profile", [False, True])
def test_struct_instr_and_kernel_parameters_follow_the_tables(sources, profile):
    src = sources[profile]
    struct = re.search(r"^struct Instr \{(.*?)^\};", src, re.M | re.S)
    assert struct, "no struct Instr"
    assert re.findall(r"^\s*int (\w+);", struct.group(1), re.M) == [f.name.lower() for f in abi.Word]
    sig = re.search(r"fusec_step\((.*?)\)\s*\{", src, re.S)
    assert sig, "no fusec_step"
    params = [re.sub(r"//[^\n]*", "", p).split() for p in re.sub(r"//[^\n]*", "", sig.group(1)).split(",")]
    assert [(" ".join(p[:-1]), p[-1]) for p in params] == [(p.ctype, p.name) for p in abi.kernel_params(profile)]


def _template_text() -> dict[str, str]:
    return {p.name: p.read_text() for p in Path(template_dir()).iterdir() if p.suffix in (".j2", ".cuh")}


def test_templates_name_fault_codes_and_layout_slots():
    """Every ``index_ok`` call passes a FUSEC_FAULT_ name (no bare code), every fault report
    passes the code it was given, the status and record writes index by name, and every layout
    name a template uses is one the header defines."""
    want = set(_expected())
    codes = {f"FUSEC_FAULT_{f.name}" for f in abi.Fault}
    calls = 0
    for name, text in _template_text().items():
        found = re.findall(r"\bindex_ok\(([^()]*)\)", text)
        assert len(found) == text.count("index_ok("), (name, "an index_ok call this test cannot read")
        for args in (a.split(",") for a in found):
            if args[0].strip().startswith("i64 "):   # the definition in common.cuh
                continue
            calls += 1
            assert len(args) == 3 and args[2].strip() in codes, (name, args)
        for m in re.finditer(r"\bfusec_report_fault\(([^)]*)\)", text):
            assert not re.search(r"^\s*\d", m.group(1)), (name, m.group(0))
        # status and record words by name: s[...] / h[...] / r[...] / rec[...] never take a literal
        bare = re.findall(r"\b(?:s|h|r|rec)\[\d+\]\s*=", text)
        assert not bare, (name, bare)
        assert not re.search(r"\bwd \+ \d", text), name
        unknown = set(_ABI_NAME.findall(text)) - want
        assert not unknown, (name, unknown)
    assert calls >= len(abi.Fault)   # the templates' guards were seen
