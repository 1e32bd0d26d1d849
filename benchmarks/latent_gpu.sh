#!/usr/bin/env bash
# The latent cache's decode kernels on one GPU, unattended (under 5 minutes): their CUDA tests (the kernels against
# float64 and the torch path in fp32 and bf16; the engine with kernels and CUDA graphs against its torch path and
# against itself eager; the latent engine against a teacher-forced pass), then `latent_decode.py` at 4k, 32k and
# 128k context, batch 8, DSA on and off. Each part's output goes to OUT_DIR; a failing part does not stop the other.
#
#     bash benchmarks/latent_gpu.sh OUT_DIR        # default OUT_DIR: $OUT
set -u
out=$(mkdir -p "${1:-${OUT:?give OUT_DIR}}" && cd "${1:-$OUT}" && pwd)
cd "$(dirname "$0")/.." && export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"

timeout 130 python -m pytest -q -rfEs -p no:cacheprovider tests/kernels/test_latent_attention_kernels.py \
    tests/inference/test_gpu_latent_cache.py 2>&1 | tee "$out/tests.log" | tail -40
echo "tests: exit ${PIPESTATUS[0]}"
cd benchmarks
timeout 160 python latent_decode.py --out "$out/latent-decode.json" 2>&1 | tee "$out/latent-decode.log" | tail -30
echo "latent_decode: exit ${PIPESTATUS[0]}"
