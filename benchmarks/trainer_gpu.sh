#!/usr/bin/env bash
# The trainer on one GPU, unattended (under 8 minutes; each part capped, all caps together 440 s): MFU of GLM-5's
# shape cut to its 3 dense blocks (MLA with DSA's top 2,048 of each query's context; no multi-token prediction layer)
# at 16k and 64k tokens a row, then FP8 training (torchao, tensorwise and rowwise) against bf16 on the Qwen3-30B-A3B
# shape cut to 4 blocks at 16k tokens. GLM-5's mixture-of-experts blocks do not fit one GPU's trainer: one is about
# 9.9e9 parameters, 158 GB with fp32 weights, gradients and AdamW's two moments. Needs torchao among the carried
# wheels (`gpu_wheels.sh` downloads it). Each part writes under OUT_DIR and a failing part (or shape: one that does
# not fit is recorded as an error) does not stop the others.
#
#     bash benchmarks/trainer_gpu.sh OUT_DIR        # PYTHON=... picks the interpreter (default: python)
source "$(dirname "$0")/gpu_script.sh" "$@"

run glm5 240 "$python" benchmarks/trainer.py --preset glm-5 --num-layers 3 --mtp-layers 0 --device cuda \
    --shapes 16384:1:1 65536:1:1 --steps 3 --warmup 1 --out "$out/trainer-glm5.json"
run moe_fp8 200 "$python" benchmarks/trainer.py --preset qwen3-30b-a3b --num-layers 4 --device cuda --shapes 16384:1:1 \
    --fp8 off tensorwise rowwise --steps 3 --warmup 1 --out "$out/trainer-moe-fp8.json"

echo "=== status"; cat "$out/status.txt"
for part in glm5 moe_fp8; do echo "=== $part"; grep -E "^[0-9]+:[0-9]+:[0-9]+ +(tandem|impl)|^shape|error|Error" "$out/$part.log" | tail -n 12; done
