"""Instruction kinds, one module each; importing this package registers them all."""
from fusec.instructions.base import KINDS, Instruction, Region, Tile, register  # noqa: F401
from fusec.instructions import generic, embedding, rms_qkv_rope, attention, matvec_residual  # noqa: F401
from fusec.instructions import rms_gate_up_silu, rms_lm_head, matvec, matvec_cols, layernorm, chain  # noqa: F401
from fusec.instructions import matvec_group, kv_roll, argmax_rows  # noqa: F401


def kind_of(op) -> type[Instruction]:
    """The instruction class that executes ``op`` (its own kind, else the generic one)."""
    return KINDS.get(op.kind, generic.Generic)
