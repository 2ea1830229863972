"""Kernel tuning knobs: the ``#define``s at the top of every rendered kernel, their defaults, what
each does, and the measurement that set its default.

The ``defines`` option (or ``FUSEC_DEFINES="NAME=VALUE,..."``) overrides a default for one
compile; a name not in :data:`KNOBS` is an error (:meth:`fusec.config.Options.from_dict`), since a
misspelt knob would do nothing. Measured on the H200 with ``benchmarks/variants.py`` in one
process per model; the sections named are those of ``docs/performance.md``. Times are per step,
Llama-3.2-1B unless said, at positions 127 / 2047.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    """One kernel knob: its ``#define`` name, default value (an int), what it does, and the
    values it takes where not every int is one (``lo``..``hi``, inclusive; None: no bound)."""
    name: str
    default: int
    doc: str
    lo: int | None = None
    hi: int | None = None


TABLE: tuple[Knob, ...] = (
    Knob("FUSEC_LOADS_IN_FLIGHT", 8,
         "16-byte weight loads in flight per lane in a matvec (4 / 6 / 12 measured 0.004-0.027 ms "
         "slower, §15; 16 2% slower, §6)"),
    Knob("FUSEC_ONE_BATCH_STEPS", 12,
         "a warp's rows of at most this many 16-byte loads per lane in all (R rows of K: K / (32 x "
         "16 B) steps each) load in one batch, not a batch of FUSEC_LOADS_IN_FLIGHT and the rest "
         "after it (two dependent L2 round trips: Gemma-2's 2304-wide rows were 8 + 1, Qwen3-0.6B's "
         "3072-wide down projection 8 + 4); 0: FUSEC_LOADS_IN_FLIGHT alone. Llama-3.2-1B's rows "
         "(8 steps x 2 rows, 32 steps) keep their batches. Loads in flight 12 for every row, H100 "
         "2026-12-07: Qwen3-0.6B -2.1%, SmolLM2-360M -2.1%, Gemma-2-2B -1.1%, Llama-3.2-3B -0.2%, "
         "Llama-3.2-1B +0.1/+0.4% (docs/performance.md, \"One batch\")", lo=0, hi=16),
    Knob("FUSEC_NORM_VEC", 1,
         "1: an RMSNorm prologue (common.cuh rms_prologue) loads x and its weight in 16-byte "
         "chunks, one of each per thread, when H / (16 B) chunks fit the CTA and both share a "
         "dtype; 0: PER elements per thread (1B -0.004 / -0.005 ms at 127 / 2047, Qwen3-0.6B "
         "within 0.003, §19)"),
    Knob("FUSEC_ATTN_PREFETCH", 1,
         "1 (2): a split-KV tile asks L2 for its V (K and V) rows before it stages q (1: 6-9 us "
         "faster than 0, §13)"),
    Knob("FUSEC_STAGE_QUEUE", 1,
         "1 copies the SM's instruction words, wait lists and the buffer table to shared memory at "
         "the start of the step, when they fit codegen.STAGE_LIMIT (15-19 us faster on the 1B, "
         "31-42 us on Qwen3-0.6B, §14)"),
    Knob("FUSEC_DISPATCH_BY_KIND", 1,
         "1: one dispatch case per distinct call (the layers of a kind share it), each op's buffer "
         "indices and spare-counter offsets in a table staged with the queue; 0: one case per op "
         "(as fast; NVRTC takes half the time with 1, §14)"),
    Knob("FUSEC_ABORT_EVERY_INSTR", 0,
         "1 reads the watchdog's abort flag after every instruction's waits; 0 once per step and "
         "while spinning (kernel.cu.j2 wait_all; 0 was 0-6 us faster, §14)"),
    # the latency knobs of §16: each removes a dependent L2 round trip (or, at short positions,
    # the split-KV merge) found in the kinds' PTX (tools/kernel_ptx.py); the six on by default
    # took the 1B from 0.861 / 0.897 / 0.931 ms to 0.826 / 0.868 / 0.900 at 127 / 2047 / 4095 and
    # Qwen3-0.6B from 0.828 / 0.919 / 1.036 to 0.797 / 0.868 / 0.991
    Knob("FUSEC_ATTN_SINGLE", 256,
         "T > 0: split 0 of each KV head does the whole head while the valid cache rows are at "
         "most min(T, the split's chunk), writing the output without partials, ticket or merge "
         "(attention_partial_merge; alone -0.018 ms at 127, with the others +-0.006 ms, §16)"),
    Knob("FUSEC_MERGE_ONE_PASS", 1,
         "1 issues the loads of a split-KV merge before its arithmetic (attention_merge.cuh "
         "merge_split_kv; up to 32 partials per head in one batch, more in batches of 16 for the "
         "max and then the sums, 2026-12-06; alone -0.016 ms on the 1B, -0.025 on Qwen3-0.6B, §16); "
         "0: the two-pass merge, a branch and loads per partial"),
    Knob("FUSEC_MERGE_LANES", 1,
         "1: a split-KV merge of more than 16 partials per head (NC > 16: one KV head, or few, at "
         "132 SMs; long length-polymorphic steps) gives each output element 2, 4 or 8 lanes of a "
         "warp, each merging at most 16 partials in one L2 round trip under its own max, combined "
         "by shuffles (attention_merge.cuh merge_split_kv_lanes); 0: one thread per element over all of them "
         "(32 partials: 96 loads per thread; more: batches of 16 for the max, then for the sums). "
         "Gemma-3-1B (one KV head, NC 32) on the H100, cache 1024, position 600: 1.393 -> 1.295 ms "
         "(excess 28.8 -> 25.0 us per layer), same error against eager; NC <= 16 (Llama-3.2-1B at "
         "1024) compiles to the same CUBIN either way (docs/performance.md, \"The split-KV merge of "
         "one KV head\")", lo=0, hi=1),
    Knob("FUSEC_EARLY_EPILOGUE_LOADS", 1,
         "1 loads a row's residual or bias (matvec_residual, matvec, rms_qkv_rope) and a q/k head "
         "epilogue's norm weight and RoPE entries before the work that precedes their use "
         "(alone -0.004 to -0.010 ms, §16)"),
    Knob("FUSEC_ATTN_Q_EARLY", 1,
         "1 loads a split-KV tile's query heads into registers before its position, so the two "
         "L2 round trips overlap (alone 0.000 to -0.008 ms, §16)"),
    Knob("FUSEC_STAGE_BATCH", 2,
         "1 loads all of a thread's 16-byte copies of a matvec's input before storing any to "
         "shared memory where they are at most 8 (alone -0.005 ms, §16); 2 also more, in rounds "
         "of 8 (a batch's inputs: B = 8 x 8192 bf16 is 16 copies per thread, each waiting for the "
         "one before with 1; Llama-3.2-1B at B = 8 1.194 -> 1.157 ms, H200, docs/batch.md)"),
    Knob("FUSEC_ATTN_KV_EARLY", 1,
         "1 asks L2 for a split-KV tile's K and V rows before its counter waits (a kind's `early` "
         "macro, kernel.cu.j2 early_instr; alone -0.006 to -0.013 ms, §16; asking before the waits "
         "of the instruction ahead of it lost up to 0.024 ms at 4095: experiments/removed-knobs.patch)"),
    Knob("FUSEC_POLL_SLEEP", 32,
         "the __nanosleep between two polls of a counter, in ns (0: none; 100 and 0 measured the "
         "same as 32, within 0.004 ms; performance.md §17)"),
    Knob("FUSEC_ATTN_LANES", 1,
         "1: a split-KV tile's scores with D / (16 bytes) lanes per cache row (two rows per lane "
         "in one batch of K loads, the dot summed by shuffles) instead of one thread per row "
         "(Qwen3-0.6B -0.003 / -0.019 / -0.047 ms at 127 / 2047 / 4095, the 1B -0.001 / -0.002 / "
         "-0.012, §17); 2: also those rows' V chunks loaded in that batch (1B +0.003 / +0.012 / "
         "0.000, Qwen3 -0.015 / -0.021 / -0.047: not the default; as 1 where a lane's q chunks "
         "take more than 32 registers)"),
    Knob("FUSEC_ATTN_KB", 2,
         "FUSEC_ATTN_LANES: the cache rows per lane whose K loads a split-KV tile issues in one "
         "batch (a CTA of 512 threads with D = 64 in bf16: 64 row slots, 2 rows each); a batch's "
         "long splits (B = 16 on Llama-3.2-1B: one split of every row per KV head) make several "
         "dependent batches; 4 and 8 measured as 2 at B = 1, 8 and 16 (H100, 2026-12-05, "
         "docs/batch.md)"),
    Knob("FUSEC_RMS_ROWS_CTA", 1,
         "1: a batched fused kind's B RMSNorms (seqs_rows.cu.j2 rms_rows_cta) over the whole CTA "
         "as batch 1's prologue, each thread's x and weight chunks in one round and a block "
         "reduction per row, where a thread has at most 4 chunks (B = 8 at H = 2048 bf16); 0, and "
         "where a thread would have more: a warp per row (8 to 16 of 16 warps busy, 3 dependent "
         "L2 round trips). Llama-3.2-1B, one process (H100, 2026-12-05, docs/batch.md): B = 8 "
         "1.371 -> 1.355 ms, K = 4 1.365 -> 1.319, K = 8 1.489 -> 1.467; B = 1 and B = 16 (8 "
         "chunks a thread: the warp path) unchanged"),
    Knob("FUSEC_ATTN_TILE_HEADS", 0,
         "the most query heads of a GQA group one split-KV tile computes (1 to 8): a group of more "
         "is cut into equal parts, each a tile group of its own that reads the KV head's rows "
         "again (from L2), so more tiles share the heads' work and each merge is smaller. 0: the "
         "rule of attention_rules.auto_q_groups (cut while a group's merge has more than 16 "
         "partials and a tile's K and V at the cache's capacity, counted as at most 4096 rows, stay "
         "within 128 KiB; a length-polymorphic step of 32768 rows is cut as a 4096-row one: "
         "Qwen2.5-0.5B 0.919 -> 0.832 ms at 100, 1.107 -> 0.934 at 3000, 1.236 -> 1.408 at 16000). Measured "
         "8 against 1 (H100, full depth, cache 4096, kernel under a CUDA graph, positions 600 / 3000 "
         "unless said): Qwen2.5-0.5B 1.006 -> 0.833 ms at 100, 1.109 -> 0.939 at 3000; SmolLM2-360M "
         "0.996 -> 0.922 / 1.007 -> 1.022; Gemma-2-2B 2.293 -> 2.285 at 100, 2.438 -> 2.455 at "
         "3000; Llama-3.2-1B 1.100 -> 1.069 / 1.112 -> 1.196; Qwen3-0.6B 0.935 -> 0.930 / 1.034 "
         "-> 1.121 (at 4096 rows the rule cuts the first two only, Gemma-2 up to 2048; at 1024 "
         "rows: Qwen2.5-0.5B 0.945 -> 0.795, SmolLM2 0.907 -> 0.849, Gemma-2 2.318 -> 2.274, "
         "docs/performance.md). Lowering reads it (the op's q_groups): set it through the "
         "defines option",
         lo=0, hi=8),
    Knob("FUSEC_ATTN_LONG_SET", 1,
         "1: a split-KV op over more than 4096 rows whose cut at its capacity differs from the cut at "
         "4096 rows (attention_rules.long_set) carries both tile sets, the position choosing one at "
         "run time (fusec/instructions/attention_sets.py: Qwen2.5-0.5B and SmolLM2 in a "
         "length-polymorphic step); 0: the 4096-row cut only, the kernel of before 2026-12-07. "
         "Measured 1 (its switch then at 128 KiB a short-set tile) against 0 (H100, full depth, cache "
         "32768, kernel under a CUDA graph, positions "
         "100 / 3000 / 6000 / 16000): Qwen2.5-0.5B 0.839 -> 0.846, 0.945 -> 0.962, 1.073 -> 1.115, "
         "1.424 -> 1.256 ms; SmolLM2-360M 0.873 -> 0.873, 1.023 -> 1.032, 1.210 -> 1.091, 1.744 -> "
         "1.368 (docs/performance.md). Lowering reads it: set it through the defines option",
         lo=0, hi=1),
    Knob("FUSEC_ATTN_BLOCK_ROWS", 512,
         "the most cache rows a split-KV tile scores in one block (shared memory: heads x rows x 4 "
         "bytes); a split of more rows runs block after block, each a dependent round of scores, "
         "softmax and values with the online-softmax rescaling. Lowering reads it (the op's "
         "`chunk`): set it through the defines option. 256 until 2026-12-05: a batch of 16 on "
         "Llama-3.2-1B (one split of every row per KV head, then 1024 rows in 4 blocks of 256) "
         "took 1.782 ms with 256, 1.767 with 1024 (H100, docs/batch.md). 512, not 1024: with the "
         "value pass's buffer a 1024-row block of 4 heads takes 33.8 KB, more than the 32 KB the "
         "1B's batch-1 kernel has (its run-time-length kernel splits 32768 rows into 2048 per "
         "split), and 40 KB more shared memory cost it 6-11 us (performance.md section 18). "
         "Batch 1 on the 1B lowers as before up to 16 x 256 = 4096 cache rows"),
    Knob("FUSEC_ATTN_V_SCATTER", 1,
         "1: a split-KV tile's value pass sums a warp's row slices by a reduce-scatter (each "
         "shuffle step halves the values a lane keeps: 24 shuffles per warp instead of 64 on the "
         "1B, 8 instead of 16 on Qwen3-0.6B); 1B -0.008 / -0.005 ms at 127 / 2047, Qwen3-0.6B "
         "+0.002 / 0.000 (§17.5); 0: the butterfly sums (the whole GPU suite passed with 1, 2026-12-02)"),
    Knob("FUSEC_PROLOGUE_REGS", 1,
         "1: a folded prologue (fusec/instructions/prologue.py: a post-norm and its residual add, "
         "a scaled residual, before a fused kind) runs in registers where its members allow "
         "(prologue_regs.py: a function per prologue, each thread on its own elements of the hidden "
         "vector, its loads up front, no barrier but a norm's reduction); 0: each member a "
         "function over shared memory with a barrier after it (the form of before 2026-12-06, and "
         "of prologues the register form cannot take). H100, full depth: Gemma-2-2B 2.423 -> "
         "2.348 ms, Granite-3.1-2B 2.481 -> 2.403, OLMo-2-1B 1.176 -> 1.160 (performance.md)"),
    Knob("FUSEC_PROJNORM_ONE_ROUND", 1,
         "1: the q/k RMSNorms over the whole projection (OLMo-2; rms_qkv_rope PROJNORM), which the "
         "last q/k tile of the step runs, load every q and k value, norm weight and RoPE entry of "
         "a thread in one round and reduce q's and k's sums of squares together, where a thread "
         "has at most 8 rotation pairs (OLMo-2-1B: 4, 7B: 8); 0: all of q (load, sum, load, rotate, "
         "store), then all of k, four dependent rounds (OLMo-2-1B 1.196 -> 1.160 ms, H100)"),
    Knob("FUSEC_SPLIT_LAST_ROUND", 1,
         "1: the rows of a matvec / matvec_residual tile past its last full round of warps (one "
         "row per warp), when they are at most half the warps and a row takes more than one batch "
         "of loads, are each split along K over the idle warps and their sums added in shared "
         "memory (matvec_split.cuh matvec_split_rows): Gemma-2-2B's 17-18-row tiles of 9216-wide "
         "rows ran their last 1-2 rows on one warp each; 0: one warp per row throughout (Gemma-2-2B 2.393 -> "
         "2.361 ms, H100, full depth; performance.md)"),
    Knob("FUSEC_ATTN_SPLIT_ROWS", 32,
         "R > 0: a split-KV op uses only the first min(NC, max(1, ceil(rows / R))) of its NC splits "
         "per KV head at run time (rows: the valid rows pos + 1, or the cache's L with a mask), "
         "about R rows each (at most R until all NC are active, more than R / 2 when two or more "
         "are); the others do no K/V work and write no partial (they "
         "still take their ticket), and the merge reads only the active partials; the block of "
         "scores grows to R rows (at most 256; past it the block loop). Lowering reads it too "
         "(the op's split_rows attr: the simulator, the block, attention_reduce's call), so set it "
         "through the defines option. 0: all NC splits, the machine code of before. Qwen2.5-0.5B "
         "(24 layers, cache 1024, 64 splits) on the H200 at 127 / 600 / 1023: 1.042 / 1.044 / "
         "0.980 ms with 0, 0.880 / 0.944 / 0.888 with 32, 0.891 / 0.946 / 0.897 with 64, "
         "0.870 / 0.925 / 0.872 with 64 and attention_merge=reduce (issue 31); Llama-3.2-1B (8 KV "
         "heads, 16 splits) at 127 / 2047: 0.824 / 0.864 ms with 0, 0.825 / 0.868 with 32. Default "
         "32 since 2026-12-04 (the GPU suite passed with it: 92 of 93, the one failure elsewhere)"),
)

#: name -> default, in the order the kernel's header defines them
KNOBS: dict[str, int] = {k.name: k.default for k in TABLE}
#: name -> (lo, hi) of the knobs that declare the values they take (:class:`Knob`)
RANGES: dict[str, tuple[int | None, int | None]] = {k.name: (k.lo, k.hi) for k in TABLE
                                                     if k.lo is not None or k.hi is not None}

#: The latency knobs' values before 2026-12-02 (all off; §16 and FUSEC_ATTN_LANES / _V_SCATTER of §17): the GPU
#: knob test and the Qwen3 / Qwen2 family GPU tests keep that path checked
LATENCY_KNOBS_OFF: dict[str, int] = {"FUSEC_ATTN_SINGLE": 0, "FUSEC_MERGE_ONE_PASS": 0,
                                     "FUSEC_EARLY_EPILOGUE_LOADS": 0, "FUSEC_ATTN_Q_EARLY": 0,
                                     "FUSEC_STAGE_BATCH": 0, "FUSEC_ATTN_KV_EARLY": 0,
                                     "FUSEC_ATTN_LANES": 0, "FUSEC_ATTN_V_SCATTER": 0}

# Mechanisms measured slower and removed (their patch series in experiments/): the L2 bulk
# prefetch of an instruction's and the next one's weights before the waits (FUSEC_PREFETCH,
# 0.10-0.15 ms slower, §9) and the kinds other than the per-layer matvecs inlined into their
# cases (FUSEC_INLINE_OTHER_KINDS, 0.031-0.052 ms slower and NVRTC 8-10x longer, §13): both in
# experiments/removed-knobs.patch; the first weight
# batch staged in shared memory or registers before the waits, an L2 prefetch of it after them,
# a warp's first weight loads before a tile's prologue (first-batch), early K/V register loads in
# the split-KV tiles (not the L2 prefetch of FUSEC_ATTN_KV_EARLY), a split-KV tile in one pass
# (attn-one-pass), shared-memory weight rings of cp.async or bulk copies (preload, tma), Qwen3's
# head norm by shuffles and value rows in batches (warpsum-vbatch), the norm weight asked for
# before the waits (norm-early); and (no change, §17; commits cc3de9f, c42c6c6) the abort flag loaded
# next to the counter in a poll (FUSEC_POLL_ONE_TRIP) and rms_qkv_rope's own loads in flight
# (FUSEC_QKV_LOADS_IN_FLIGHT); a level's or a layer's weights asked of L2 ahead after each release
# (FUSEC_L2_AHEAD, l2-ahead): docs/performance.md, "What was tried". At B > 1 (docs/batch.md):
# the fused kinds' B RMSNorms in one round with the norm weight asked of L1, and a tile's first
# weights asked of L2 while it stages its inputs (FUSEC_RMS_ROWS_ONE_ROUND, FUSEC_SEQS_L2_PREFETCH,
# experiments/batch-prologue-l2.patch: 1.157 -> 1.229 / 1.219 ms at B = 8).
