#!/usr/bin/env bash
# The latent cache's decode kernels on one GPU, unattended (under 5 minutes): their CUDA tests (the kernels against
# float64 and the torch path in fp32 and bf16; the engine with kernels and CUDA graphs against its torch path and
# against itself eager; the latent engine against a teacher-forced pass; FP8 latent blocks with kernels and graphs
# against bf16), then `latent_decode.py` at 4k, 32k and 128k context, batch 8, DSA on and off. Each part's output
# goes to OUT_DIR; a failing part does not stop the other.
#
#     bash benchmarks/latent_gpu.sh OUT_DIR        # default OUT_DIR: $OUT; PYTHON=... picks the interpreter
source "$(dirname "$0")/gpu_script.sh" "$@"

run tests 130 "$python" -m pytest -q -rfEs -p no:cacheprovider tests/kernels/test_latent_attention_kernels.py \
    tests/inference/test_gpu_latent_cache.py \
    tests/inference/test_fp8_latent_engine.py::test_fp8_latent_engine_on_cuda_stays_close_to_bf16
tail -40 "$out/tests.log"
run latent_decode 160 "$python" benchmarks/latent_decode.py --out "$out/latent-decode.json"
tail -30 "$out/latent_decode.log"
