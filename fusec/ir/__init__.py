"""The IR and what the passes share: the graph (``graph``), the pattern language the passes
match with (``pattern``), the reference semantics of every op (``semantics``, ``env``), the
position counters (``position``), the pieces a slice, split or index cuts from a product
(``pieces``) and the schedule the last pass produces (``schedule``).

``from fusec.ir import Graph, Op, Ref, Role, TensorInfo`` names the graph's types.
"""
from fusec.ir.graph import Graph, Op, Ref, Role, TensorInfo

__all__ = ["Graph", "Op", "Ref", "Role", "TensorInfo"]
