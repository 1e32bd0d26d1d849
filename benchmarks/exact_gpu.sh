#!/usr/bin/env bash
# Exact mode on one GPU, unattended (about 5 minutes; each part capped, all caps together 530 s): its GPU tests, the engine on workloads A and B
# (Qwen3-0.6B, random weights) without and with `--exact` (with it, the mismatch against the exact trainer's
# forward, which must be 0), and its kernels against torch's. Each part writes under OUT_DIR and a failing part
# does not stop the others.
#
#     bash benchmarks/exact_gpu.sh OUT_DIR        # PYTHON=... picks the interpreter (default: python)
source "$(dirname "$0")/gpu_script.sh" "$@"

run_tests tests 150 tests/kernels/test_batch_invariant.py tests/trainer/test_exact_parity.py \
    -k "cuda" --junitxml "$out/tests.xml"
model=$(mktemp -d)/qwen3-0.6b
run model 60 "$python" -c "from pathlib import Path; from tandem.models.presets import init_model; init_model('qwen3-0.6b', Path('$model'))"
cd benchmarks
run engine 100 "$python" inference.py --model "$model" --device cuda --parts engine --workloads A,B --repeats 1 \
    --out "$out/engine.json"
run engine_exact 160 "$python" inference.py --model "$model" --device cuda --parts engine,mismatch --workloads A,B --repeats 1 \
    --exact --out "$out/engine_exact.json"
run kernels 60 "$python" exact_kernels.py --out "$out/exact_kernels.json"
rm -rf "$(dirname "$model")"
