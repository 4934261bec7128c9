# `make serve` and `make test` each set everything up first: a virtual environment in .venv, the
# package with its dependencies, llama-cpp-python built for this machine, and the default model.
# `make setup BACKEND=vulkan` (or cuda, rocm, metal) builds llama-cpp-python for that GPU
# backend instead, into the same .venv; later targets keep the backend it was set up with.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BACKEND ?= $(or $(shell cat $(VENV)/.backend 2>/dev/null),cpu)
# Portable build: a native build (GGML_NATIVE=ON) dies with SIGILL on CPUs that report AMX the
# virtual machine does not enable. AVX2 is the floor. GGML_OPENMP=OFF: ggml's own threadpool, since
# OpenMP's decodes ~3x slower when llama_decode is called from any thread but the main one.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DLLAVA_BUILD=OFF -DGGML_OPENMP=OFF
# llama.cpp's own switch for each GPU backend, beside the CPU flags (its CPU backend runs the
# layers that are not offloaded).
GPU_CMAKE_ARGS_vulkan := -DGGML_VULKAN=ON
GPU_CMAKE_ARGS_cuda := -DGGML_CUDA=ON
GPU_CMAKE_ARGS_rocm := -DGGML_HIP=ON
GPU_CMAKE_ARGS_metal := -DGGML_METAL=ON

# NVIDIA Dynamo for `prefixgate --dynamo`, without its dependencies: pyproject's `dynamo` extra
# lists the ones it needs (ai-dynamo's `aisimulate` is a placeholder that cannot be installed).
DYNAMO := ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1

.PHONY: setup serve test test-vulkan lint bench bench-dynamo bench-models bench-gpu system-deps agents image-check

setup: $(VENV)/.installed-$(BACKEND)

$(VENV)/.installed-$(BACKEND): pyproject.toml Makefile deploy/build_llama_cpp.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	rm -f $(VENV)/.installed-*
	deploy/build_llama_cpp.sh $(BACKEND) $(PY) "$(LLAMA_CMAKE_ARGS) $(GPU_CMAKE_ARGS_$(BACKEND))"
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps $(DYNAMO)
	$(PY) -m gateway.workers.model_store
	echo $(BACKEND) > $(VENV)/.backend
	touch $@

serve: setup
	$(PY) -m gateway $(ARGS)

lint: setup
	$(PY) -m ruff check .

test: lint system-deps agents
	$(PY) -m pytest $(PYTEST_ARGS)

# The GPU paths (tests marked `gpu`) on Vulkan through Mesa's software driver (lavapipe: a CPU
# device, which llama.cpp uses only when GGML_VK_VISIBLE_DEVICES names it), with llama-cpp-python
# built for Vulkan in a venv of its own (the first build takes minutes, then it is cached).
# GGML_VK_DISABLE_FUSION: Debian 12's lavapipe (Mesa 22.3.6) segfaults running one of
# llama.cpp's fused shaders (a flash-attention batch of 2+ rows after a one-row one); Mesa 25
# does not, but takes minutes where Mesa 22 takes seconds. Real GPUs keep fusion.
LAVAPIPE := /usr/share/vulkan/icd.d/lvp_icd.x86_64.json
test-vulkan:
	$(MAKE) setup VENV=.venv-vulkan BACKEND=vulkan
	@test -e $(LAVAPIPE) || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers)
	GGML_VK_VISIBLE_DEVICES=0 VK_ICD_FILENAMES=$(LAVAPIPE) GGML_VK_DISABLE_FUSION=1 \
		.venv-vulkan/bin/python -m pytest -m gpu $(PYTEST_ARGS)

# The agent CLIs the tests drive against the server, pinned, from npm (into .agents/; Claude
# Code and Codex bring their native binaries as npm packages, ~360 and ~170 MB). npm comes
# with Node (20 or newer), installed with apt when missing.
AGENTS := .agents
AGENT_CLIS := @anthropic-ai/claude-code@2.1.328 @openai/codex@0.169.0
agents: $(AGENTS)/.installed

$(AGENTS)/.installed: Makefile
	@command -v npm >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm)
	npm install --prefix $(AGENTS) --no-audit --no-fund --loglevel=error $(AGENT_CLIS)
	touch $@

# What the tests run besides Python: a real redis-server, docker-compose to validate
# compose.yaml, headless Chromium with its driver for the cache page, Prometheus (with
# promtool) to scrape a gateway for the dashboard's queries and check the config, etcd for
# Dynamo's discovery, and iproute2's `ip` for the Dynamo nodes' network namespaces. Installed
# with apt when missing (as root, on Debian or Ubuntu): command -> the package that provides it.
SYSTEM_DEPS := redis-server:redis-server docker-compose:docker-compose chromium:chromium \
	chromedriver:chromium-driver prometheus:prometheus promtool:prometheus etcd:etcd-server \
	ip:iproute2
# $(call apt_missing,PAIRS): installs the packages of the command:package pairs whose command
# is missing.
apt_missing = @missing=""; for pair in $(1); do command -v $${pair%%:*} >/dev/null || \
		missing="$$missing $${pair\#\#*:}"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
system-deps:
	$(call apt_missing,$(SYSTEM_DEPS))

# The Dockerfile's steps in clean Debian roots (mmdebstrap, then chroot; no Docker engine
# needed), then its gateway started until its HEALTHCHECK passes: 22 minutes on a busy 2-core
# machine, 20 of them compiling llama.cpp, so not part of `make test`. As root.
IMAGE_CHECK_DEPS := mmdebstrap:mmdebstrap unshare:util-linux ip:iproute2
image-check:
	$(call apt_missing,$(IMAGE_CHECK_DEPS))
	$(PYTHON) -m tests.image_check $(ARGS)

# The side-by-side benchmark (tens of minutes): installs llama-cpp-python's server, builds
# llama-server once, runs every system and writes docs/benchmarks.md with its plots.
bench: setup
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --quiet -e ".[test,bench]"
	test -x .bench/llama-server || BACKEND=cpu loadtest/build_llama_server.sh
	$(PY) -m loadtest.bench --docs docs/benchmarks.md $(ARGS)

# Scale-out on NVIDIA Dynamo (docs/dynamo.md, ~20 minutes): three prefixgate nodes behind
# prefixgate's front and Dynamo's frontend, beside plain replicas sharing Redis, for both models.
bench-dynamo: setup
	$(call apt_missing,redis-server:redis-server)
	$(PY) -m loadtest.dynamo_bench $(ARGS)

# Several models behind one gateway beside llama-server's router mode (docs/models.md, ~10
# minutes): cold and warm TTFT, alternating between two models with one loaded, memory.
bench-models: setup
	test -x .bench/llama-server || BACKEND=cpu loadtest/build_llama_server.sh
	$(PY) -m loadtest.models_bench $(ARGS)

# The GPU benchmark (docs/gpu.md, minutes): prefixgate beside llama-server, both built for the
# backend .venv was set up with (`make setup BACKEND=cuda`), every layer on the device; builds
# llama-server for that backend once and prints the table.
LLAMA_SERVER := .bench/llama-server$(if $(filter-out cpu,$(BACKEND)),-$(BACKEND))
bench-gpu: setup
	test -x $(LLAMA_SERVER) || BACKEND=$(BACKEND) loadtest/build_llama_server.sh
	$(PY) -m loadtest.gpu_bench --backend $(BACKEND) $(ARGS)
