#!/usr/bin/env bash
# On the GPU machine, from the repository root: FUSEC_ATTN_TILE_HEADS (the most query heads of a
# GQA group one split-KV tile computes; lowering reads it) at 8 (the kernels before the default
# rule, attention_rules.auto_q_groups) and 1, for the
# families with the most query heads per KV head and the fewest KV heads (Qwen2.5-0.5B: 7 over 2;
# Gemma-2-2B: 2 over 4), at a short and a long position (cache 4096), full depth, kernel under a
# CUDA graph (benchmarks/families.py); then the GPU attention tests with the knob at 1.
#   bash tools/tile_heads_ab.sh [FAMILIES]    (default qwen2,gemma2; tables to stdout, JSON to $OUT)
FAMS=${1:-qwen2,gemma2}
OUT=${OUT:-build/tile_heads_ab}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v root | tail -2
export PYTHONUNBUFFERED=1 FUSEC_CACHE_DIR=${FUSEC_CACHE_DIR:-/tmp/fc} PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader
for prefill in 100 3000; do
  for n in 8 1; do
    echo "== FUSEC_ATTN_TILE_HEADS=$n, prefill $prefill"
    timeout 120 python3 benchmarks/families.py --families "$FAMS" --peer none --steps 30 --prefill $prefill \
      --max-cache-len 4096 --options "{\"defines\": {\"FUSEC_ATTN_TILE_HEADS\": $n}}" \
      --out "$OUT/heads-$n-$prefill.json" 2>&1 | grep "^[a-z0-9_]* *|" | grep -v "^family"
  done
done
FUSEC_DEFINES=FUSEC_ATTN_TILE_HEADS=1 timeout 200 python3 -m pytest -q -m gpu -n 8 --dist loadfile \
  -p no:cacheprovider tests/test_gpu_families.py tests/test_attention_split.py tests/test_attention_head_dims.py \
  tests/test_gpu_batch.py 2>&1 | tail -4
