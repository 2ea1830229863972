#!/usr/bin/env bash
# On the GPU machine, from the repository root: the two tile sets of a split-KV op
# (fusec/instructions/attention_sets.py, knob FUSEC_ATTN_LONG_SET) against one set (the 4096-row
# cut only) and no cut (FUSEC_ATTN_TILE_HEADS=8), in one process per model, full depth, a
# 32768-row StaticCache (the capacity of HF generate()'s length-polymorphic step), kernel under a
# CUDA graph, logits checked against HF eager at every position (benchmarks/variants.py).
#   bash tools/long_set_ab.sh [EXAMPLES]   (default: examples/qwen2_5_0_5b.py; tables to stdout)
#   POSITIONS="100 3000 6000 16000" bash tools/long_set_ab.sh
EXAMPLES=${1:-examples/qwen2_5_0_5b.py}
OUT=${OUT:-build/long_set_ab}
POSITIONS=${POSITIONS:-100 3000 6000 16000}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FUSEC_CACHE_DIR=${FUSEC_CACHE_DIR:-/tmp/fc} PYTHONPATH=.
V='[{"name": "two sets (default)"},
    {"name": "one set (LONG_SET=0)", "options": {"defines": {"FUSEC_ATTN_LONG_SET": 0}}},
    {"name": "uncut (TILE_HEADS=8)", "options": {"defines": {"FUSEC_ATTN_TILE_HEADS": 8}}}]'
for ex in ${EXAMPLES//,/ }; do
  python3 benchmarks/variants.py --example "$ex" --positions $POSITIONS --steps 100 --variants "$V" \
    --out "$OUT/$(basename "$ex" .py).json" 2>&1 | grep -v "^INFO\|^fusec\|^\s*$" | tail -16
done
