#!/usr/bin/env bash
# On the GPU machine, from the repository root: the pending experiment series of experiments/
# against main, in one device call (about 8 minutes). For each series: a copy of the tree with
# the series applied (git apply, or patch -p1 where git is missing), its GPU tests, then the
# timing. Tables and logs go to $OUT (or build/exp_ab). Run there as:  bash tools/exp_ab.sh
# Measurements: docs/performance.md "Next" says what each variant predicts.
set -u
OUT=${OUT:-build/exp_ab}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 FUSEC_CACHE_DIR=/tmp/fc
ROOT=$(pwd)
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install failed"

tree_with() {   # tree_with SERIES: a copy of the tree at /tmp/exp_SERIES with the series applied
  local d=/tmp/exp_$1
  rm -rf "$d" && mkdir -p "$d"
  tar --exclude=.venv --exclude=build --exclude=.git -cf - . | tar -xf - -C "$d"
  (cd "$d" && { git apply "experiments/$1.mbox" 2>/dev/null || patch -s -p1 < "experiments/$1.mbox"; }) \
    || { echo "$1: does not apply"; return 1; }
}

variants() {    # variants TREE OUT_JSON ARGS...: benchmarks/variants.py run from TREE's code
  local tree=$1 out=$2; shift 2
  (cd "$tree" && PYTHONPATH="$tree" timeout 300 python3 benchmarks/variants.py --steps 100 --out "$out" "$@" 2>&1 \
    | grep -v "^INFO\|^stage\|^fusec:\|^\s*$" | tail -12)
}

# 1. early-batch: the knobs against the default (and the out-of-line kinds of main against inlining)
if tree_with early-batch; then
  (cd /tmp/exp_early-batch && PYTHONPATH=/tmp/exp_early-batch timeout 200 python3 -m pytest -q -p no:cacheprovider \
    --tb=short -m gpu tests/test_gpu.py -k knobs 2>&1 | tail -3)
  variants /tmp/exp_early-batch "$OUT/early-batch.json" --positions 127 2047 --variants '[
    {"name": "base"},
    {"name": "inline-other", "options": {"defines": {"FUSEC_INLINE_OTHER_KINDS": 1}}},
    {"name": "early4", "options": {"defines": {"FUSEC_EARLY_BATCH": 4}}},
    {"name": "early8", "options": {"defines": {"FUSEC_EARLY_BATCH": 8}}},
    {"name": "attn-v", "options": {"defines": {"FUSEC_ATTN_PREFETCH": 1}}},
    {"name": "attn-kv", "options": {"defines": {"FUSEC_ATTN_PREFETCH": 2}}}]'
fi

# 2. qkv-split: its Qwen3 GPU tests, then Qwen3-0.6B from main's tree and from the series' tree
if tree_with qkv-split; then
  (cd /tmp/exp_qkv-split && PYTHONPATH=/tmp/exp_qkv-split timeout 200 python3 -m pytest -q -p no:cacheprovider \
    --tb=short -m gpu tests -k qwen3 2>&1 | tail -3)
  variants "$ROOT" "$OUT/qwen3-main.json" --example examples/qwen3_0_6b.py --positions 127 2047 \
    --variants '[{"name": "main"}]'
  variants /tmp/exp_qkv-split "$OUT/qwen3-split.json" --example examples/qwen3_0_6b.py --positions 127 2047 \
    --variants '[{"name": "qkv-split"}]'
fi
