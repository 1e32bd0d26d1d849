#!/usr/bin/env bash
# Prefill/decode disaggregation on one GPU, unattended (under 9 minutes): the CUDA tests of the KV hand-off (no host
# sync in export and import, imports beside a step change no token, step records' device times) and of a
# disaggregated pair, then the staggered-arrival workload (Qwen3-0.6B shape, 64 requests decoding 128 -> 512 tokens
# while 8,192-token prompts arrive every 100 ms) colocated against a prefill and a decode server on the same GPU
# (`shared_memory`), with `--isolate`: the same decode server beside a busy prefill server with nothing handed over,
# then alone, which separates the shared device's contention from the hand-off's own cost; then the same workload
# again (colocated and `shared_memory`) with every server's interpreter-lock switch interval at 0.5 ms
# (`server.switch_interval_ms`; Python's default is 5). Each setup's result includes its slow steps broken down
# against the median ones.
#
#     bash benchmarks/disaggregated_gpu.sh OUT_DIR        # PYTHON=... picks the interpreter (default: python)
source "$(dirname "$0")/gpu_script.sh" "$@"

run_tests tests 200 tests/inference/test_gpu_hand_off.py \
    tests/inference/test_gpu_disaggregated.py
tail -20 "$out/tests.log"
run pd 180 "$python" benchmarks/disaggregated.py --device cuda --preset qwen3-0.6b --num-decoding 64 \
    --decode-prompt-len 128 --output-len 512 --long-prompt-len 8192 --arrival-ms 100 --long-in-flight 8 \
    --kv-transports shared_memory --isolate --out "$out/pd-gpu.json"
grep -E '"(output_tokens_per_s|tbt_p50_ms|tbt_p99_ms|tbt_p99_over_p50|hand_off_ms_per_1k_tokens|share_of_slow)"|^ "[a-z_]+": \{' \
    "$out/pd.log" | head -80
run pd_switch 150 "$python" benchmarks/disaggregated.py --device cuda --preset qwen3-0.6b --num-decoding 64 \
    --decode-prompt-len 128 --output-len 512 --long-prompt-len 8192 --arrival-ms 100 --long-in-flight 8 \
    --kv-transports shared_memory --switch-interval-ms 0.5 --out "$out/pd-gpu-switch.json"
grep -E '"(output_tokens_per_s|tbt_p50_ms|tbt_p99_ms|tbt_p99_over_p50|share_of_slow)"|^ "[a-z_]+": \{' \
    "$out/pd_switch.log" | head -40
