#!/usr/bin/env bash
# On the GPU machine, from the repository root: FUSEC_ATTN_TILE_HEADS (the most query heads of a
# GQA group one split-KV tile computes; lowering reads it; 0, the default, is the rule
# attention_rules.auto_q_groups) at each of HEADS, for the families given (default: those with
# the most query heads per KV head and the fewest KV heads, Qwen2.5-0.5B: 7 over 2; Gemma-2-2B:
# 2 over 4), at each position of PREFILLS over a StaticCache of CACHE rows, full depth, kernel
# under a CUDA graph (benchmarks/families.py); then, unless TESTS=0, the GPU attention tests with
# the knob at 1.
#   bash tools/tile_heads_ab.sh [FAMILIES]      (tables to stdout, JSON to $OUT)
#   CACHE=32768 PREFILLS="100 3000 16000" HEADS="0 8" TESTS=0 bash tools/tile_heads_ab.sh qwen2,smollm2
#     (the rule, which counts a capacity as at most 4096 rows, against no cut, at the 32768 rows
#     of a length-polymorphic step: docs/performance.md "The rule at a run-time length")
FAMS=${1:-qwen2,gemma2}
OUT=${OUT:-build/tile_heads_ab}
CACHE=${CACHE:-4096} PREFILLS=${PREFILLS:-100 3000} HEADS=${HEADS:-8 1} TESTS=${TESTS:-1}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v root | tail -2
export PYTHONUNBUFFERED=1 FUSEC_CACHE_DIR=${FUSEC_CACHE_DIR:-/tmp/fc} PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader
for prefill in $PREFILLS; do
  for n in $HEADS; do
    echo "== FUSEC_ATTN_TILE_HEADS=$n, prefill $prefill, cache $CACHE"
    timeout 150 python3 benchmarks/families.py --families "$FAMS" --peer none --steps 30 --prefill "$prefill" \
      --max-cache-len "$CACHE" --options "{\"defines\": {\"FUSEC_ATTN_TILE_HEADS\": $n}}" \
      --out "$OUT/heads-$n-$prefill-$CACHE.json" 2>&1 | grep "^[a-z0-9_]* *|" | grep -v "^family"
  done
done
[ "$TESTS" = 0 ] && exit 0
FUSEC_DEFINES=FUSEC_ATTN_TILE_HEADS=1 timeout 200 python3 -m pytest -q -m gpu -n 8 --dist loadfile \
  -p no:cacheprovider tests/test_gpu_families.py tests/test_attention_split.py tests/test_attention_head_dims.py \
  tests/test_gpu_batch.py 2>&1 | tail -4
