# The two commands of the README: `make demo` and `make test`. Both set up .venv when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test test-slow lint setup eval-env clean

# Packages are byte-compiled on every core at once (pip compiles file by file: 39 -> 33 s on 2 cores)
# and kept compiled: every test process imports jax, flax and TFDS again.
$(STAMP): requirements.txt requirements-dev.txt constraints.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip==26.3
	$(BIN)/python -m pip install -q --no-compile -r requirements-dev.txt -c constraints.txt
	$(BIN)/python -m pip install -q --no-compile --no-deps -e .
	$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null
	touch $(STAMP)

setup: $(STAMP)

# lmms-eval in its own environment (it needs PyTorch; vitmm does not): tests/test_lmms_eval.py runs
# it against vitmm.serve. ~18 s from pip's cache; not byte-compiled (the test runs it once).
EVAL_VENV := .venv-eval
EVAL_STAMP := $(EVAL_VENV)/.installed
$(EVAL_STAMP): requirements-eval.txt
	test -x $(EVAL_VENV)/bin/python || $(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/python -m pip install -q --upgrade pip==26.3
	$(EVAL_VENV)/bin/python -m pip install -q --no-compile --no-deps -r requirements-eval.txt
	touch $(EVAL_STAMP)

eval-env: $(EVAL_STAMP)

# glibc >= 2.35 then backs malloc's large blocks with transparent huge pages: XLA:CPU's per-step
# temporaries stop page-faulting 4 KiB at a time (make demo: 9.6M -> 0.27M faults, ~7% less time;
# README "CPU speed against PyTorch"). Older glibc ignores it; a GLIBC_TUNABLES of your own is kept.
TUNABLES := $(if $(GLIBC_TUNABLES),$(GLIBC_TUNABLES):)glibc.malloc.hugetlb=1

# The main job: pretrain a small CLIP on synthetic scenes (built on first use), evaluate, save.
demo: $(STAMP)
	GLIBC_TUNABLES=$(TUNABLES) $(BIN)/python -m vitmm.train --config configs/clip_scenes.py --workdir workdirs/clip_scenes

lint: $(STAMP)
	$(BIN)/ruff check vitmm tests configs experiments

# The two environments are set up side by side (pip installs one file at a time), then the tests run.
# The project's own modules are byte-compiled first: with PYTHONDONTWRITEBYTECODE set (as on these
# machines) every one of the dozens of processes the tests start would compile them again (~0.15-0.3 s each).
test:
	$(MAKE) --no-print-directory -j2 lint $(EVAL_STAMP)
	$(BIN)/python -m compileall -q -j 0 vitmm experiments configs tests >/dev/null
	VITMM_LMMS_EVAL_PYTHON=$(CURDIR)/$(EVAL_VENV)/bin/python $(BIN)/python -m pytest -n 2 -m "not slow" $(PYTEST_ARGS)

# The tests marked slow: end-to-end runs whose behaviour a cheaper test in make test also checks.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(EVAL_VENV) .pytest_cache .ruff_cache
