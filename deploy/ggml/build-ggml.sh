#!/bin/sh
# Builds and installs ggml-python, the bindings corral drives ggml through, around llama.cpp's own ggml.
#   build-ggml.sh PIP CONSTRAINTS [CMAKE_ARGS]
# ggml-python (its version pinned in CONSTRAINTS) vendors an older ggml; llama.cpp's sources, taken from the
# llama-cpp-python sdist pinned there too, carry the ggml llama-server runs. Its CPU backend multiplies prompt
# rows by K-quant weights without a repacked layout (Q6_K: half the ffn_down and attn_v weights of a Q4_K_M
# file) in tiled int8 kernels instead of one dot product per row and column: Qwen2.5 1.5B's 450-token prompt
# ran at llama-server's speed with it (docs/measured-choices.md#ggml-from-llamacpp). ggml_tensor and the
# functions corral binds are the same in both, so the bindings drive the newer library unchanged.
set -eu
pip=$1
constraints=$2
cmake_args=${3:-}
pin() { grep -E "^$1==" "$constraints" | head -n 1 | cut -d= -f3; }
bindings=$(pin ggml-python)
sources=$(pin llama-cpp-python)
if [ -z "$bindings" ] || [ -z "$sources" ]; then
    echo "build-ggml: $constraints must pin ggml-python and llama-cpp-python" >&2
    exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "build-ggml: ggml-python $bindings around the ggml of llama-cpp-python $sources (downloading the sources)"
"$pip" download --quiet --no-deps --no-binary ggml-python,llama-cpp-python --dest "$work" \
    "ggml-python==$bindings" "llama-cpp-python==$sources"
tar -xzf "$work/ggml_python-$bindings.tar.gz" -C "$work"
tar -xzf "$work/llama_cpp_python-$sources.tar.gz" -C "$work" "llama_cpp_python-$sources/vendor/llama.cpp/ggml"
rm -rf "$work/ggml_python-$bindings/vendor/ggml"
mv "$work/llama_cpp_python-$sources/vendor/llama.cpp/ggml" "$work/ggml_python-$bindings/vendor/ggml"
echo "build-ggml: compiling (about a minute on 2 cores) with CMAKE_ARGS=$cmake_args"
CMAKE_ARGS="$cmake_args" "$pip" install --quiet --no-deps --no-cache-dir --force-reinstall "$work/ggml_python-$bindings"
