# The two commands of the README: `make demo` and `make test`. Both set up .venv when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test test-slow lint setup eval-env clean

# uv installs the pinned wheels in parallel and byte-compiles them on every core (pip, one file at a
# time: 61 s for both environments on this 2-core machine; uv: ~20 s). Packages stay compiled: every
# test process imports jax, flax and TFDS again. uv does not read pip's configuration, so a local
# wheel folder that pip is told of (PIP_FIND_LINKS, e.g. the CPU torch of .venv-eval) is passed on.
UV := $(BIN)/uv
UV_INSTALL = $(UV) pip install -q $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))

$(UV):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv==0.11.0

$(STAMP): requirements.txt requirements-dev.txt constraints.txt pyproject.toml | $(UV)
	$(UV_INSTALL) --compile-bytecode --python $(BIN)/python -r requirements-dev.txt -c constraints.txt
	$(UV_INSTALL) --compile-bytecode --python $(BIN)/python --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

# lmms-eval in its own environment (it needs PyTorch; vitmm does not): tests/test_lmms_eval.py runs
# it against vitmm.serve. Byte-compiled by importing what its OpenAI path imports (3.5k modules, ~20 s
# on one core, beside .venv's install) rather than all of it (torch alone: ~30 s more); its test then
# starts lmms-eval in ~7 s instead of ~18.
EVAL_VENV := .venv-eval
EVAL_STAMP := $(EVAL_VENV)/.installed
LMMS_EVAL_IMPORTS := import lmms_eval.__main__, lmms_eval.cli.dispatch, lmms_eval.evaluator, \
	lmms_eval.models.simple.openai, lmms_eval.models.chat.openai, lmms_eval.tasks; lmms_eval.tasks.TaskManager()
$(EVAL_STAMP): requirements-eval.txt | $(UV)
	test -x $(EVAL_VENV)/bin/python || $(PYTHON) -m venv --without-pip $(EVAL_VENV)
	$(UV_INSTALL) --python $(EVAL_VENV)/bin/python --no-deps -r requirements-eval.txt
	env -u PYTHONDONTWRITEBYTECODE HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
		$(EVAL_VENV)/bin/python -c "$(LMMS_EVAL_IMPORTS)" >$(EVAL_VENV)/imports.log 2>&1 \
		|| { tail -5 $(EVAL_VENV)/imports.log; exit 1; }
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

# The two environments are set up side by side, then the tests run.
# The project's own modules are byte-compiled first: with PYTHONDONTWRITEBYTECODE set (as on these
# machines) every one of the dozens of processes the tests start would compile them again (~0.15-0.3 s each).
# The tests run as the demo does (huge pages for XLA:CPU's temporaries), the two workers stealing each
# other's queued tests so that neither waits idle behind a long one at the end.
test:
	$(MAKE) --no-print-directory -j2 lint $(EVAL_STAMP)
	$(BIN)/python -m compileall -q -j 0 vitmm experiments configs tests >/dev/null
	GLIBC_TUNABLES=$(TUNABLES) VITMM_LMMS_EVAL_PYTHON=$(CURDIR)/$(EVAL_VENV)/bin/python \
		$(BIN)/python -m pytest -n 2 --dist worksteal -m "not slow" $(PYTEST_ARGS)

# The tests marked slow: end-to-end runs whose behaviour a cheaper test in make test also checks.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(EVAL_VENV) .pytest_cache .ruff_cache
