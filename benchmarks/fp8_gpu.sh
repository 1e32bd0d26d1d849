#!/usr/bin/env bash
# The FP8 engine on one GPU, unattended (under 7 minutes; each part capped, all caps together 375 s): the FP8 CUDA
# tests; the dense FP8 product's sweep, writing its table for this GPU (fp8_tiles.json); the FP8 experts' tiles
# (moe_tiles.json: the shipped table's shapes, if any, and the tuned FP8 ones); then the Qwen3-30B-A3B shape cut to
# 12 blocks on workload A, bf16 against FP8 with both tables, each profiled by kernel group. Each part writes under
# OUT_DIR and a failing part does not stop the others; what matters is printed at the end.
#
#     bash benchmarks/fp8_gpu.sh OUT_DIR        # PYTHON=... picks the interpreter (default: python)
source "$(dirname "$0")/gpu_script.sh" "$@"

run_tests tests 150 tests/kernels/test_fp8.py tests/kernels/test_pointwise.py \
    "tests/inference/test_fp8_engine.py::test_fp8_on_cuda_with_a_tile_table_stays_close_to_bf16" -k cuda \
    --junitxml "$out/tests.xml"
cd benchmarks
run sweep 75 "$python" fp8_matmul.py --shapes all --token-counts 1,16,64,256,512,2048,4096 --moe-preset '' \
    --out "$out/fp8_matmul.json" --table-out "$out/fp8_tiles.json"
# Workload A's decode batch (256 sequences; fewer take the same entry) and its prefill chunk (4,096 tokens).
run moe_tune 50 "$python" moe_tune.py --preset qwen3-30b-a3b --fp8 --token-counts 256,4096 --budget-s 30 \
    --out "$out/moe_fp8"
if [ -f "$out/moe_fp8/moe_tiles.json" ]; then  # the GPU's shipped shapes (bf16's tuned tiles), then the FP8 ones
    "$python" - "$out/moe_fp8/moe_tiles.json" "$out/moe_tiles.json" <<'EOF'
import json, sys
from pathlib import Path
from tandem.kernels.moe_tiles import shipped_table_path
tuned = json.loads(Path(sys.argv[1]).read_text())
shipped = shipped_table_path(tuned["device"])
merged = json.loads(shipped.read_text()) if shipped.is_file() else dict(tuned, shapes={})
merged["shapes"].update(tuned["shapes"])
Path(sys.argv[2]).write_text(json.dumps(merged, indent=1) + "\n")
EOF
fi
tables=()
[ -f "$out/fp8_tiles.json" ] && tables+=(--fp8-tile-table "$out/fp8_tiles.json")
[ -f "$out/moe_tiles.json" ] && tables+=(--moe-tile-table "$out/moe_tiles.json")
run engine 100 "$python" inference.py --preset qwen3-30b-a3b --num-layers 12 --device cuda --parts engine --workloads A \
    --quantizations none,fp8 --fp8-experts --repeats 1 --profile "${tables[@]}" --out "$out/engine_A.json"

echo "=== status"; cat "$out/status.txt"
echo "=== tests"; tail -n 15 "$out/tests.log"
echo "=== dense FP8 product: per shape and token count, the table's choice and microseconds (bf16, rule, best)"
"$python" - "$out/fp8_tiles.json" <<'EOF'
import json, sys
from pathlib import Path
path = Path(sys.argv[1])
table = json.loads(path.read_text()) if path.is_file() else {"shapes": {}}
for key, entries in table["shapes"].items():
    for e in entries:
        us = e["us"]
        print(f"{key:<16} {e['num_tokens']:>5} {e['product']:<9} {json.dumps(us)} {json.dumps(e.get('tiles'))}")
EOF
grep -E "error|refus" "$out/sweep.log" | head -n 5
echo "=== FP8 experts"; grep -E '^\{"num_tokens"|wrote' "$out/moe_tune.log" | cut -c1-400
echo "=== engine"; grep -A 12 -E "^--- (prefill|decode): GPU ms" "$out/engine.log"; tail -n 40 "$out/engine.log"
