#!/usr/bin/env bash
# On the GPU machine: install fusec from the tree (no deps) and run pytest with the given args.
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v root | tail -2
export PYTHONUNBUFFERED=1 FUSEC_CACHE_DIR=/tmp/fc
timeout 540 python3 -m pytest -q -x -p no:cacheprovider -p no:logging --tb=short "$@" 2>&1 | tee $OUT/log.txt | grep -v "^DEBUG" | tail -60
