"""No import circle in fusec (issue 30, item 9): every ``import`` of a fusec module by another,
at module level or inside a function, forms a DAG, so that a lower stage never needs a higher
one (the IR and its semantics below the instruction kinds, the CUDA stages below the pipeline,
the cache that wraps it and the runtime that loads what they make)."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    mods = {}
    for p in list(ROOT.glob("fusec/**/*.py")) + list(ROOT.glob("passes/*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        if parts[0] == "passes":   # shipped as fusec.passes
            parts = ("fusec",) + parts
        name = ".".join(parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


def import_graph() -> nx.DiGraph:
    """Module -> the fusec modules it imports (any ``import``/``from ... import`` in its source;
    a child importing its own package does not count: the package is initialized first)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name or None

    g = nx.DiGraph()
    for m, p in mods.items():
        g.add_node(m)
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                t = resolve(n)
                if t and t != m and not m.startswith(t + "."):
                    g.add_edge(m, t)
    return g


def test_fusec_has_no_import_circle():
    g = import_graph()
    assert g.number_of_nodes() > 50 and g.number_of_edges() > 100   # the walk saw the package
    circles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not circles, circles


def test_the_ir_and_the_cuda_stages_import_no_higher_stage():
    """The IR (``fusec.ir``) imports no instruction kind, pass, frontend or runtime module; the
    CUDA stages (``fusec.cuda``) nothing of the runtime or the frontend."""
    g = import_graph()
    bad = [(a, b) for a, b in g.edges
           if (a.startswith("fusec.ir.") and b.startswith(("fusec.passes", "fusec.frontend", "fusec.runtime",
                                                           "fusec.cuda", "fusec.sim")))
           or (a.startswith("fusec.ir.") and a != "fusec.ir.schedule" and b.startswith("fusec.instructions"))
           or (a.startswith("fusec.cuda") and b.startswith(("fusec.runtime", "fusec.frontend")))]
    assert not bad, bad


def test_the_runtime_only_loads_and_launches():
    """``fusec.runtime`` imports none of the compile stages (``fusec.pipeline``, the passes), the
    artifact cache (``fusec.cache``) or the frontend that drives them; the pipeline and the cache
    import nothing of the runtime."""
    g = import_graph()
    assert "fusec.cache.artifacts" in g and "fusec.runtime.load" in g
    bad = [(a, b) for a, b in g.edges
           if (a.startswith("fusec.runtime") and b.startswith(("fusec.pipeline", "fusec.passes", "fusec.cache",
                                                               "fusec.frontend", "fusec.api")))
           or (a.startswith(("fusec.pipeline", "fusec.cache")) and b.startswith("fusec.runtime"))]
    assert not bad, bad
