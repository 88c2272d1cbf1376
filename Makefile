# Set-up and entry points. `make serve` and `make test` are the two commands the README opens with;
# both create the virtual environment from this repository's own files on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest-xdist workers for `make test`; 0 runs the suite in one process. Whole files go to a worker
# (--dist loadfile), so a module's server or model fixture starts once. The suite is bound by the 2 cores:
# three workers took 23:19 against two's 23:49 (2026-11-28), and made deadline-bound tests flakier.
TEST_WORKERS ?= 2
# ggml sums its float16 products in float32 on CPUs with AVX512-FP16 too: its native build there sums them in
# float16, which overflows in attention over a float16 KV cache (corral/kernels/half_sums.py). A compiler that
# does not know the flag cannot emit those instructions either.
GGML_C_FLAGS := $(shell echo | $(CC) -mno-avx512fp16 -x c -E - >/dev/null 2>&1 && echo -mno-avx512fp16)

.PHONY: install serve test lint clean

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -c constraints.txt -e '.[bench,dev]'
	$(BIN)/pip install -c constraints.txt --no-deps instructor  # see the dev extra in pyproject.toml
	# The ggml extra: ggml-python's bindings built around llama.cpp's own ggml (deploy/ggml/build-ggml.sh, ~1 min on
	# 2 cores). Without it corral runs the same, decode steps of few rows slower (corral/kernels/row_kernel.py) and
	# GGUF files served from a float copy. llamafile's tinyBLAS is switched on, as llama.cpp builds it (the package
	# leaves it off): its tiles multiply several rows ~20 % faster on AVX2. GGML_C_FLAGS: float32 sums (above).
	sh deploy/ggml/build-ggml.sh $(BIN)/pip constraints.txt \
		"-DGGML_LLAMAFILE=ON -DCMAKE_C_FLAGS=$(GGML_C_FLAGS) -DCMAKE_CXX_FLAGS=$(GGML_C_FLAGS)" \
		|| echo "warning: the ggml extra did not build (no C compiler?); fp16 steps of few rows stay on fbgemm"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/corral serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info
