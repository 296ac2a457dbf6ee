# The two commands of README.md: `make demo` and `make test`. Each sets up .venv from a fresh clone:
# it reuses the machine's CUDA torch when there is one, else installs torch==2.14.1, then builds the
# extension (pip install --no-build-isolation -e .) and runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CUDA_HOME ?= /usr/local/cuda
export CUDA_HOME
TORCH_PIN ?= torch==2.14.1
DEV_DEPS := numpy tqdm pytest safetensors ninja pybind11 "peft>=0.13" "transformers>=4.45" matplotlib
SOURCES := setup.py pyproject.toml $(shell find csrc -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.h' 2>/dev/null)

.PHONY: demo test serve-sim bench clean

$(VENV)/.deps:
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
		echo "using the machine's CUDA torch"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q "$(TORCH_PIN)"; \
	fi
	$(PY) -m pip install -q $(DEV_DEPS)
	touch $@

$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

demo: $(VENV)/.built
	$(VENV)/bin/lora-kernels serve-sim

serve-sim: $(VENV)/.built
	$(VENV)/bin/lora-kernels serve-sim

test: $(VENV)/.built
	$(PY) -m pytest -q -ra tests

clean:
	rm -rf $(VENV) build *.egg-info lora_kernels/_C*.so lora_kernels/_build_meta.py
