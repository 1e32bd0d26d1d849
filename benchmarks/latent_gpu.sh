#!/usr/bin/env bash
# The latent cache's decode kernels on one GPU, unattended (under 8 minutes): their CUDA tests (the kernels against
# float64 and the torch path in fp32 and bf16, over a cache in the model's dtype and an FP8 one; the engine with
# kernels and CUDA graphs against its torch path and against itself eager; the latent engine against a
# teacher-forced pass, over its cache in fp32 and in FP8; FP8 weights (`engine.quantization`) with kernels and graphs
# against bf16; MTP drafts with the MoE kernels, bf16 and FP8; DSA's attention over chosen entries and its index
# scores in bf16 on tensor cores), then `latent_decode.py` at 4k, 32k and 128k context,
# batch 8, DSA (GLM-5's mode) and dense MLA (DSA off), each over a bf16 and an FP8 cache, then exact mode's CUDA
# parity of the latent families and of MTP drafts against the exact trainer. Each part's output goes to OUT_DIR; a
# failing part does not stop the others.
#
#     bash benchmarks/latent_gpu.sh OUT_DIR        # default OUT_DIR: $OUT; PYTHON=... picks the interpreter
source "$(dirname "$0")/gpu_script.sh" "$@"

run_tests tests 220 tests/kernels/test_latent_attention_kernels.py \
    tests/inference/test_gpu_latent_cache.py \
    tests/inference/test_fp8_latent_engine.py::test_fp8_latent_engine_on_cuda_stays_close_to_bf16 \
    tests/inference/test_mtp_draft.py::test_on_cuda_the_mtp_layers_experts_run_the_engines_kernels \
    tests/models/test_chosen_attention.py tests/models/test_glm_moe_dsa.py::test_index_scores_of_bf16_on_cuda_are_the_fp32_scores_of_the_same_values
tail -40 "$out/tests.log"
run latent_decode 120 "$python" benchmarks/latent_decode.py --modes dsa dense --kv-cache-dtypes auto fp8 --repeats 10 \
    --out "$out/latent-decode.json"
tail -30 "$out/latent_decode.log"
run_tests exact 120 tests/trainer/test_exact_parity.py -k "cuda and (latent or mtp)"
tail -30 "$out/exact.log"
