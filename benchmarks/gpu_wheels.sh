#!/usr/bin/env bash
# The wheels the `*_gpu.sh` scripts and the CUDA tests need on an offline GPU host whose image already has torch,
# Triton and transformers (Python 3.12, x86-64): tandem's server and test dependencies at the versions
# constraints.txt pins, downloaded here into OUT_DIR. There, before a script:
#
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site OUT_DIR/*.whl
#     export PYTHONPATH=/tmp/site PYTHON=python3
#
#     bash benchmarks/gpu_wheels.sh OUT_DIR        # PYTHON_VERSION=3.12 by default
set -euo pipefail
out=${1:?usage: bash $0 OUT_DIR}
cd "$(dirname "$0")/.."
names=(fastapi annotated-doc starlette pydantic pydantic_core annotated-types typing-inspection uvicorn httptools h11
       msgspec sniffio opentelemetry-api tomli_w rich markdown-it-py mdurl Pygments typing_extensions anyio click
       httpx httpcore certifi idna prometheus_client pytest-timeout openai jiter distro httpx2 httpcore2 truststore torchao)
pins=()
for name in "${names[@]}"; do
    pin=$(grep -i -m1 -E "^${name//[-_]/[-_]}==" constraints.txt) || { echo "constraints.txt pins no $name" >&2; exit 1; }
    pins+=("$pin")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" --implementation cp \
    "${platforms[@]}" -d "$out" "${pins[@]}"
echo "${#pins[@]} wheels in $out ($(du -sh "$out" | cut -f1))"
