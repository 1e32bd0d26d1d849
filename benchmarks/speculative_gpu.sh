#!/usr/bin/env bash
# Speculative decoding on one GPU, unattended (under 3 minutes, each part capped): its CUDA tests, then n-gram
# speculation against the default engine (Qwen3-0.6B shape, random weights, 64 x 128 -> 256, k = 4) at T = 0 (greedy
# random weights loop: drafting pays if anywhere) and T = 1 (nothing repeats: the rule declines, so the engine should
# cost what the default costs) with the per-part breakdown of a step, and the greedy case again with a higher
# drafting bar. Results and logs go under OUT_DIR.
#
#     bash benchmarks/speculative_gpu.sh OUT_DIR        # PYTHON=... picks the interpreter (default: python)
source "$(dirname "$0")/gpu_script.sh" "$@"
shape=(--preset qwen3-0.6b --device cuda --requests 64 --prompt-tokens 128 --max-tokens 256 --breakdown)

run_tests tests 50 tests/inference/test_gpu_speculative.py
tail -4 "$out/tests.log"
echo "== n-gram against the default engine, T = 0 and 1"
run ngram 80 "$python" benchmarks/speculative.py "${shape[@]}" --temperatures 0,1 --engines default,ngram \
    --out "$out/spec-ngram-breakdown.json"
grep -v -i warn "$out/ngram.log" | tail -34
echo "== n-gram alone, T = 0, drafting bar 1.5 accepted drafts a sequence (compare with the default's T = 0 above)"
run ngram_bar15 45 "$python" benchmarks/speculative.py "${shape[@]}" --temperatures 0 --engines ngram \
    --min-expected-tokens 1.5 --out "$out/spec-ngram-bar15.json"
grep -v -i warn "$out/ngram_bar15.log" | tail -12
