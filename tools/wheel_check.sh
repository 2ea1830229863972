#!/usr/bin/env bash
# The installed package works, not only the checkout: build the wheel from the working tree,
# install it (no dependencies: the .venv has them) into a fresh folder put first on PYTHONPATH,
# and from a folder outside the tree run its `fusec compile examples/tiny_llama.py --emit-cuda`,
# which renders every template (a file missing from the package data fails here). Called by
# `make wheel-check` (and .ci/run after `make test`). PYTHON: the interpreter (default .venv's).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
case "$PY" in   # absolute: the check runs from another folder
    /*) ;;
    */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;;
    *) PY="$(command -v "$PY")" ;;
esac
TMP="$(mktemp -d "${TMPDIR:-/tmp}/fusec-wheel-check.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/src" "$TMP/run"

# build from a copy of the tree (tracked files and untracked ones git does not ignore), so that
# the build leaves nothing in the checkout
git -C "$ROOT" ls-files -z --cached --others --exclude-standard |
    tar -C "$ROOT" --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -C "$TMP/src" -xf -
"$PY" -m pip wheel --no-deps --no-build-isolation -q -w "$TMP/dist" "$TMP/src"
WHEEL="$(ls "$TMP"/dist/fusec-*.whl)"
"$PY" -m pip install --no-deps --no-compile -q --target "$TMP/site" "$WHEEL"

cd "$TMP/run"   # outside the tree: nothing of the checkout is importable from here
export PYTHONPATH="$TMP/site" FUSEC_CACHE=0 FUSEC_CACHE_DIR="$TMP/cache"
"$PY" - "$TMP/site" <<'EOF'
import sys
import fusec
site = sys.argv[1]
where = fusec.__file__
if not where.startswith(site):
    sys.exit(f"wheel check: fusec imported from {where}, not from the installed wheel in {site}")
if not str(fusec.template_dir()).startswith(site):
    sys.exit(f"wheel check: templates from {fusec.template_dir()}, not from the wheel")
EOF
"$TMP/site/bin/fusec" compile "$ROOT/examples/tiny_llama.py" -o "$TMP/out" --emit-cuda
if [ ! -s "$TMP/out/kernel.cu" ] || [ ! -s "$TMP/out/kernel.cubin" ]; then
    echo "wheel check: fusec compile --emit-cuda wrote no kernel.cu / kernel.cubin" >&2
    exit 1
fi
echo "wheel check: $(basename "$WHEEL") installed outside the tree compiles examples/tiny_llama.py (kernel.cu written)"
