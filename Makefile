# Set-up and use: `make demo` and `make test` each create or refresh .venv themselves.
PYTHON ?= python3
# .venv's interpreter: PYTHON where it is given (make PYTHON=..., or the environment), else
# Debian's /usr/bin/python3.11 where there is one. It is built with PGO and LTO; the python3
# found first on these machines (pyenv's 3.11.7) is built without them, and the test suite,
# mostly pure Python (dynamo's tracing), took 25% more CPU time with it (74.5 -> 56.0 CPU-s for
# test_hf_decode.py and 11 fuzz configurations, 61.4 -> 49.9 for test_generic_cuda.py). An
# existing .venv keeps its interpreter: `rm -rf .venv` to make it again.
VENV_PYTHON := $(if $(filter file,$(origin PYTHON)),$(or $(wildcard /usr/bin/python3.11),$(PYTHON)),$(PYTHON))
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv demo test wheel-check bench bench-chat bench-batch bench-families bench-families-2 clean

venv: $(VENV)/.stamp

$(VENV)/.stamp: requirements.txt pyproject.toml setup.py
	$(VENV_PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=64"
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

demo: venv
	@echo "== a tiny Llama (2 layers): its step on the simulator, every output checked against eager (relative error <= 1e-4)"
	$(BIN)/fusec compile examples/tiny_llama.py -o build/demo-tiny --simulate
	@echo "== the random Llama-3.2-1B at full depth: the schedule, its kernel (NVRTC), on a GPU the step run"
	$(BIN)/fusec compile examples/llama_3_2_1b.py -o build/demo --simulate --emit-cuda --run

# on every core (pytest-xdist), each test file on one worker (a file's tests may build on each
# other: the README's blocks run in order); the fuzz file's independent tests are handed out one
# by one (tests/conftest.py, INDEPENDENT_FILES)
test: venv
	$(BIN)/python -m pytest -q -n auto --dist loadfile

# the installed package, not the checkout: build the wheel, install it outside the tree (no
# dependencies: .venv's) and compile examples/tiny_llama.py with --emit-cuda from another folder
wheel-check: venv
	PYTHON=$(BIN)/python tools/wheel_check.sh

# GPU machine only: it runs from the tree with the .venv's python where there is one, else with
# $(PYTHON) (the GPU machine has no .venv: nothing can be installed there). MODEL picks the example
# model (examples/qwen3_0_6b.py, llama_3_2_3b.py, llama_3_1_8b.py; default the Llama-3.2-1B)
MODEL ?= examples/llama_3_2_1b.py
RUN_PY = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
bench:
	PYTHONPATH=. $(RUN_PY) benchmarks/decode.py --example $(MODEL) --out build/bench-$(basename $(notdir $(MODEL))).json
	PYTHONPATH=. $(RUN_PY) benchmarks/chat.py --example $(MODEL) --out build/chat-$(basename $(notdir $(MODEL))).json

# the chat row alone (also the second part of bench): ten generate calls with new prompt lengths
# per user path, in a cold then a warm process
bench-chat:
	PYTHONPATH=. $(RUN_PY) benchmarks/chat.py --example $(MODEL) --out build/chat-$(basename $(notdir $(MODEL))).json

# batch B = 1..16 and K = 1..8 query-token steps of the Llama-3.2-1B against inductor, and HF
# generate() of a batch of 4 (issue 32's table; K > 1 with the non-default option query_tokens)
bench-batch:
	PYTHONPATH=. $(RUN_PY) benchmarks/batch.py --out build/batch-bench.json

# fusec vs HF eager and inductor per decoder family at the published widths and full depth
# (prefill 600, StaticCache 1024; floor, share, excess per layer); GPU machine only, as bench.
# All families take long on one GPU: FAMILIES=llama,gemma2 runs a subset. bench-families-2: the
# README table's older setting, 2 decoder layers each, StaticCache 512, prefill 16
FAMILIES ?=
FAMILIES_ARG = $(if $(FAMILIES),--families $(FAMILIES))
bench-families:
	PYTHONPATH=. $(RUN_PY) benchmarks/families.py $(FAMILIES_ARG) --out build/families-bench.json
bench-families-2:
	PYTHONPATH=. $(RUN_PY) benchmarks/families.py --layers 2 --prefill 16 --max-cache-len 512 $(FAMILIES_ARG) --out build/families-bench-2.json

clean:
	rm -rf build dist *.egg-info .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
