"""The docs stay true to the code: docs/generated-cuda.md's kernel layout table is what
tools/generated_cuda_table.py renders today, every relative link and every backticked repository
path of README.md and docs/*.md exists, and measurement JSON lives in benchmarks/results/."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: top-level folders whose paths the docs name in backticks
REPO_DIRS = ("fusec/", "passes/", "templates/", "tests/", "tools/", "benchmarks/", "examples/", "docs/")


def test_generated_cuda_table_is_current():
    """CPU only (codegen, no NVRTC): fails after a template or codegen change moved the tiny kernel's
    parts; run ``.venv/bin/python tools/generated_cuda_table.py`` and commit the table."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import generated_cuda_table as gct
    finally:
        sys.path.remove(str(ROOT / "tools"))
    doc, new = gct.expected_doc()
    assert doc == new, ("docs/generated-cuda.md's kernel layout table is out of date: run "
                        ".venv/bin/python tools/generated_cuda_table.py")


def test_relative_links_resolve():
    bad = []
    for md in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", md.read_text()):
            path = target.split("#")[0]
            if not path or re.match(r"[a-z]+:", path):
                continue
            if not (md.parent / path).exists():
                bad.append(f"{md.relative_to(ROOT)}: {target}")
    assert not bad, "links to missing files:\n" + "\n".join(bad)


def test_backticked_repo_paths_exist():
    """A path in backticks that starts at a top-level folder of the repository (`fusec/cuda/gen`,
    `benchmarks/results/...json`) names a file or folder that exists; placeholders (`<kind>`, `*`,
    `...`) are skipped, and `file.py::name` or `file.py:line` count as the file."""
    bad = []
    for md in DOCS:
        for token in re.findall(r"`([^`\s]+)`", md.read_text()):
            if not token.startswith(REPO_DIRS) or re.search(r"[<>*…{}$]|\.\.\.", token):
                continue
            path = re.split(r"::|:(?=\d)", token)[0].rstrip(".,;:")
            if not (ROOT / path).exists():
                bad.append(f"{md.relative_to(ROOT)}: `{token}`")
    assert not bad, "paths that do not exist:\n" + "\n".join(bad)


def test_measurement_json_lives_in_benchmarks_results():
    assert not list((ROOT / "docs").glob("*.json")), "move measurement JSON to benchmarks/results/ (git mv)"
    assert list((ROOT / "benchmarks" / "results").glob("bench-*.json"))


def test_the_docs_index_lists_every_page():
    """docs/README.md, the index a reader starts from (issue 30, item 12), links every page of
    docs/ with a line on what it holds; a page added without it fails here."""
    index = (ROOT / "docs" / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    listed = set(re.findall(r"^\| \[([\w.-]+\.md)\]\(\1\) \| \S", index, flags=re.M))
    assert pages and set(pages) == listed, (sorted(set(pages) - listed), sorted(listed - set(pages)))


def test_measurements_page_is_tables_of_current_facts():
    """docs/measurements.md is tables of current facts, not a journal (issue 30, item 12): every
    section but the short History holds a table whose rows cite where they come from (a date and
    a command, JSON file or commit), and no heading is a date or a session."""
    text = (ROOT / "docs" / "measurements.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert sections
    titles = [s.splitlines()[0] for s in sections]
    assert not [t for t in titles if re.match(r"(\d{4}-\d\d-\d\d|[Ss]ession)", t)], titles
    assert not re.search(r"^#{3,} .*(\d{4}-\d\d-\d\d|[Ss]ession \d)", text, flags=re.M)
    for s in sections:
        title, body = s.splitlines()[0], s.splitlines()[1:]
        if title == "History":
            assert len([ln for ln in body if ln.strip()]) <= 15, "History grows: move facts into the tables"
            continue
        rows = [ln for ln in body if ln.startswith("|") and not re.match(r"\|[\s|:-]+\|?$", ln)]
        assert len(rows) >= 2, f"section {title!r} has no table"
        cited = "\n".join(body)
        assert re.search(r"\d{4}-\d\d-\d\d", cited) and re.search(r"`[^`]+`|\.json|[0-9a-f]{7}", cited), title
