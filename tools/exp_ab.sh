#!/usr/bin/env bash
# On the GPU machine, from the repository root: one experiment series of experiments/ against
# main in one device call. A copy of the tree with the series applied (git apply, or patch -p1
# where git is missing: the machine gets no git history), the kernel-knob GPU tests there, then
# benchmarks/variants.py from that copy at positions 127 and 2047 for each example model given
# (default the Llama-3.2-1B), the variants in one process. Tables and logs go to $OUT (or
# build/exp_ab).
#
#   bash tools/exp_ab.sh SERIES 'VARIANTS_JSON' [EXAMPLE_PY ...] [-- VARIANTS_ARGS ...]
#
# e.g. the one-pass split-KV tile against the default, with the first variant's timeline:
#   bash tools/exp_ab.sh attn-one-pass '[{"name": "one-pass", "options": {"defines":
#     {"FUSEC_ATTN_ONE_PASS": 1}}}, {"name": "base"}]' -- --profile "$OUT/prof"
# Measurements and verdicts: docs/performance.md, "What was tried" and "Next".
set -u
[ $# -ge 2 ] || { sed -n 2,14p "$0"; exit 2; }
SERIES=$1 VARIANTS=$2
shift 2
EXAMPLES=() EXTRA=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; EXTRA=("$@"); break; fi
  EXAMPLES+=("$1"); shift
done
[ ${#EXAMPLES[@]} -gt 0 ] || EXAMPLES=(examples/llama_3_2_1b.py)
OUT=${OUT:-build/exp_ab}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 FUSEC_CACHE_DIR=/tmp/fc
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install failed"

TREE=/tmp/exp_$SERIES
rm -rf "$TREE" && mkdir -p "$TREE"
tar --exclude=.venv --exclude=build --exclude=.git -cf - . | tar -xf - -C "$TREE"
(cd "$TREE" && { git apply "experiments/$SERIES.mbox" 2>/dev/null || patch -s -p1 < "experiments/$SERIES.mbox"; }) \
  || { echo "$SERIES: does not apply"; exit 1; }
cd "$TREE" || exit 1
PYTHONPATH="$TREE" timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu tests/test_gpu.py -k knobs 2>&1 | tail -3
for ex in "${EXAMPLES[@]}"; do
  name=$(basename "$ex" .py)
  PYTHONPATH="$TREE" timeout 300 python3 benchmarks/variants.py --steps 100 --positions 127 2047 --example "$ex" \
    --variants "$VARIANTS" --out "$OUT/$SERIES-$name.json" "${EXTRA[@]}" 2>&1 \
    | grep -v "^INFO\|^stage\|^fusec:\|^\s*$" | tail -12
done
