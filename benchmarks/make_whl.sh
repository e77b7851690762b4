#!/usr/bin/env bash
# Fill the checkout's .whl/ (ignored by git) with what benchmarks/h200.sh installs or builds on
# the GPU machine, which reaches no package index: the gguf, pyyaml and tqdm wheels for its
# Python (3.12), and, for LLAMA runs, llama.cpp's source as the llama-cpp-python source
# distribution vendors it, trimmed to fit a device call's 64 MiB (models, docs, benches,
# media, the web UI and the SYCL, Vulkan and OpenCL backends left out: ~7.8 MB).
#
#   bash benchmarks/make_whl.sh [LLAMA_CPP_PYTHON_VERSION]   (default 0.3.36)
#
# Then carry it with each device call: carry [".whl"].
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-0.3.36}
py=${WHL_PYTHON:-3.12}
mkdir -p .whl
python3 -m pip download -q --no-deps --python-version "$py" --only-binary :all: -d .whl \
    gguf pyyaml tqdm
if [ ! -s .whl/llama.cpp.tar.gz ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" \
        "llama-cpp-python==$version"
    tar xzf "$tmp"/llama_cpp_python-"$version".tar.gz -C "$tmp"
    src="$tmp/llama_cpp_python-$version/vendor"
    rm -rf "$src"/llama.cpp/{models,docs,benches,media,tools/ui} \
        "$src"/llama.cpp/ggml/src/ggml-{sycl,vulkan,opencl}
    tar czf .whl/llama.cpp.tar.gz -C "$src" llama.cpp
fi
ls -la .whl
du -sh .whl
