"""abi: the layouts the host (Python) and the megakernel (CUDA) share, written once.

Every number both sides must agree on is in one of these tables. ``templates/abi.cuh.j2``
renders them into ``#define`` lines at the top of every kernel (``FUSEC_ST_*``, ``FUSEC_WD_*``,
``FUSEC_FAULT_*``, ``FUSEC_PROF_*``, ``FUSEC_WORD``), and ``kernel.cu.j2`` renders ``struct
Instr`` and the parameter list of ``fusec_step`` from them; the templates use the names, never
the numbers. The Python side imports them from here: codegen packs the instruction words, the
runtime builds the launch's parameter array and decodes the status, the simulator raises its
index faults with the kernel's codes. ``tests/test_abi.py`` parses the rendered header back and
compares it with these tables.

Tables (all int32 words unless said):

- :class:`Word`: the fields of one instruction word, ``WORD`` of them (``struct Instr``).
- :class:`Status`: the int64 header words of the host-mapped status, ``ST_HEAD`` of them; the
  watchdog's records follow the header.
- :class:`WdRecord`: the fields of one watchdog record, ``WD_REC`` of them, one record per SM:
  in the device watchdog buffer ``wd`` after its ``WD_HEAD`` words, and copied to the
  host-mapped status after its header. :class:`Claim`: the values of a record's ``CLAIMED``.
- :class:`Fault`: the index-fault codes ``index_ok`` records, with the words the host's message
  uses for each.
- :class:`Prof`: the fixed fields of a profiling build's per-instruction record (uint64,
  %globaltimer ns), then ``PROF_MARKS`` mark slots.
- :data:`PARAMS`: the parameters of the kernel ``fusec_step``, in order (:func:`kernel_params`).

This module imports nothing of fusec: the IR's simulator semantics, the CUDA stages and the
runtime all read it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Slot(enum.IntEnum):
    """An IntEnum whose members carry what they mean: declared as ``NAME = value, "doc"``,
    read as ``member.doc``; ``member`` is the int (an index into a word array, or a code)."""

    doc: str

    def __new__(cls, value: int, doc: str = "") -> Slot:
        obj = int.__new__(cls, value)
        obj._value_ = value
        obj.doc = doc
        return obj


class Word(Slot):
    """The int32 fields of one instruction word, in order (the kernel's ``struct Instr`` has a
    field of each, named in lower case). Codegen packs ``WORD`` of them per instruction, the
    instructions of an SM's queue one after another."""

    OP = 0, "opcode: the op's index in the schedule, also the index of the counter it signals"
    P0 = 1, "tile parameter 0 (the kind's encode(), padded with zeros to four)"
    P1 = 2, "tile parameter 1"
    P2 = 3, "tile parameter 2"
    P3 = 4, "tile parameter 3"
    WAIT_OFF = 5, "its first wait in the wait lists, in (counter, tiles) pairs"
    WAIT_CNT = 6, "its number of waits"
    ID = 7, "instruction id (index in Schedule.instrs; the row of its profiling record)"


#: int32 per instruction word
WORD = len(Word)


class Status(Slot):
    """The int64 header words of the host-mapped status (page-locked host memory the kernel
    writes through ``fusec_status``, the host reads without a sync). The kernel writes a record,
    fences, then sets its flag and ``ANY`` last."""

    ANY = 0, "1: something was recorded (set last)"
    FAULT = 1, "1: an index fault was recorded (CODE, VALUE, BOUND)"
    CODE = 2, "the fault's code (fusec.abi.Fault)"
    VALUE = 3, "the out-of-range index"
    BOUND = 4, "its exclusive upper bound"
    WATCHDOG = 5, "1: the watchdog fired; its records follow the header"


#: int64 header words of the host-mapped status (those not in :class:`Status` are unused); the
#: watchdog's records (:class:`WdRecord`, ``WD_REC`` int32 per SM) start after them
ST_HEAD = 8


class WdRecord(Slot):
    """The int32 fields of one watchdog record: one record per SM (CTA), written by the first
    thread of the SM's CTA whose counter wait timed out or saw the abort flag."""

    CLAIMED = 0, "the slot's state (fusec.abi.Claim)"
    SM = 1, "the SM (CTA index) that waited"
    QUEUE_INDEX = 2, "the instruction's index in the instruction words (queue_off[sm] + its place in the queue)"
    OP = 3, "its opcode"
    COUNTER = 4, "the counter it waited on (the producer op's index)"
    VALUE = 5, "the counter's value when it gave up"
    TARGET = 6, "the step's epoch (the wait was for the producer's tiles x epoch)"
    INSTRUCTION = 7, "its instruction id"


#: int32 per watchdog record
WD_REC = len(WdRecord)

#: int32 words of the device watchdog buffer ``wd`` before its records: ``wd[0]`` is the abort
#: flag every spinning wait polls, the others are unused
WD_HEAD = 8


class Claim(Slot):
    """The values of a watchdog record's ``CLAIMED`` field (set by atomicCAS from ``FREE``)."""

    FREE = 0, "no record"
    RECORD = 1, "a record: this SM's stuck wait (the host reads these)"
    SKIP = 2, "taken, no record: the SM left on the abort flag without a stuck wait of its own"


class Fault(Slot):
    """Index-fault codes: which run-time index ``index_ok`` found out of range (the kernel
    skipped the access; the host raises IndexFaultError). ``doc`` is what the message calls it;
    ``INDEX`` is also the code of a generated gather's index (index_select, gather, index)."""

    TOKEN_ID = 1, "token id or learned position (embedding row)"
    INDEX = 2, "position (table lookup)"
    ROPE_POS = 3, "RoPE position"
    KV_POS = 4, "KV-cache write position"
    ATTN_POS = 5, "attention position"


def fault_remedy(code: int, value: int, bound: int, what: str) -> str:
    """What an index fault's message tells the user (``what``: the index as the message names
    it). A position past fusec's position tables (RoPE cos/sin, computed when the step was
    built for ``[0, bound)``: the KV cache's rows unless option ``position_rows`` is set) is
    one eager computes, so the remedy is that option; any other index out of range is one eager
    PyTorch raises IndexError for (an embedding row: a token id, or a learned position past the
    model's table, GPT-2's ``wpe``). The kernel's ``INDEX`` code is also a generated gather's."""
    if code == Fault.ROPE_POS or (code == Fault.INDEX and what.startswith("position")):
        from fusec.config import MAX_CACHE_LEN
        if value < 0:
            fix = "eager computes RoPE at a negative position; fusec's position tables start at 0"
        elif value >= MAX_CACHE_LEN:
            fix = (f"eager computes RoPE at any position, fusec's position tables end at {MAX_CACHE_LEN} "
                   "(fusec.config.MAX_CACHE_LEN, the largest option position_rows)")
        elif value == bound:   # the step after the cache's last row (the KV write faults too)
            fix = (f"a KV cache of {bound} rows is full at position {value} (eager raises IndexError writing that "
                   "row): use a longer cache (StaticCache's max_cache_len, or generate()'s max_new_tokens); a "
                   f"model whose own position table has {bound} rows (GPT-J's embed_positions) ends there too, as "
                   "eager's index does; where the model's positions run past its cache's rows (a rolled sliding "
                   f"window), build the step with option position_rows={value + 1} or more")
        else:
            fix = (f"fusec's position tables were computed for positions [0, {bound}) when the step was built "
                   "(the KV cache's rows) and eager computes any position: build the step with option "
                   f"position_rows={value + 1} or more (torch.compile(..., options={{'position_rows': N}}))")
        return fix + ("; a gathered index out of range instead is one eager raises IndexError for"
                      if "gathered" in what else "")
    if code == Fault.TOKEN_ID:
        return ("eager PyTorch raises IndexError for it (where the table holds learned positions, GPT-2's wpe: "
                "the sequence, prompt and new tokens, is longer than the config's max_position_embeddings / n_positions)")
    return "eager PyTorch raises IndexError for it"


class Prof(Slot):
    """The fixed uint64 fields of a profiling build's per-instruction record (%globaltimer ns,
    but the SM); its ``FUSEC_MARK(k)`` timestamps follow (``PROF_MARKS`` slots, 0: not taken)."""

    SM = 0, "the SM (CTA index) that ran it"
    FETCHED = 1, "its word was read and its counter waits began"
    READY = 2, "its waits were satisfied"
    DONE = 3, "its template returned (before the counter's release add)"


#: FUSEC_MARK(k) slots per instruction in a profiling build (k < PROF_MARKS)
PROF_MARKS = 6


@dataclass(frozen=True)
class Param:
    """One parameter of the kernel ``fusec_step``: its name, its C type and what it is."""

    name: str
    ctype: str
    doc: str


#: the kernel's parameters in launch order (the runtime's parameter array follows it)
PARAMS: tuple[Param, ...] = (
    Param("instrs", "const Instr* __restrict__", "the instruction words (Word), by SM in queue order"),
    Param("queue_off", "const int* __restrict__", "num_sms + 1 offsets of each SM's queue, in instructions"),
    Param("waits_g", "const int* __restrict__", "the wait lists: (counter, the producer's tiles) pairs"),
    Param("counters", "unsigned*", "one counter per op (its index), then the spare ones; never reset"),
    Param("epochs", "unsigned*", "per SM: the epoch (1-based step number) it last finished"),
    Param("bufs_g", "void* const* __restrict__", "the pointer table: a pointer per root buffer, or a run-time length"),
    Param("wd", "int*", "the device watchdog: WD_HEAD words (wd[0]: the abort flag), then WD_REC per SM"),
    Param("timeout_ns", "unsigned long long", "how long a counter wait spins before the watchdog fires, ns"),
)
#: the profiling build's extra last parameter
PROF_PARAM = Param("prof", "unsigned long long*",
                   "[instructions, len(Prof) + PROF_MARKS] records, written by each instruction")


def kernel_params(profile: bool) -> tuple[Param, ...]:
    """The parameters of ``fusec_step`` in order; ``profile``: a profiling build's."""
    return PARAMS + ((PROF_PARAM,) if profile else ())
