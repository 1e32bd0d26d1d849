"""`benchmarks/moe_tune.py`: its grid stays within what a block holds, and the script runs end to end under
Triton's interpreter (tiny preset, a grid of two tiles) and writes a table the engine loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.kernels.moe_tiles import TileTable, rule_tiles, shape_key

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import moe_tune  # noqa: E402
from triton_interpreter import needs_triton_interpreter


def test_row_blocks_follow_the_rows_per_expert():
    args = moe_tune.moe_args_of("qwen3-30b-a3b")  # 128 experts, top-8: a token count / 16 rows per expert
    assert moe_tune.block_ms(1, args) == [16] and moe_tune.block_ms(32, args) == [16]
    assert moe_tune.block_ms(256, args) == [16, 32] and moe_tune.block_ms(512, args) == [16, 32, 64]
    assert moe_tune.block_ms(1024, args) == [16, 32, 64, 128] and moe_tune.block_ms(8192, args) == [64, 128]
    with pytest.raises(SystemExit, match="not a mixture of experts"):
        moe_tune.moe_args_of("tiny")


@pytest.mark.parametrize("matmul", moe_tune.MATMULS)
def test_the_grid_leaves_out_tiles_a_block_cannot_hold(matmul):
    for block_m in (16, 32, 64, 128):
        grid = moe_tune.coarse_grid(block_m, matmul, quick=False)
        assert grid and all(moe_tune.fits(t, matmul == "gate_up") for t in grid)
        for tiles in grid:
            near = moe_tune.fine_grid(tiles, matmul)
            assert all(t != tiles and t["BLOCK_N"] >= 32 and moe_tune.fits(t, matmul == "gate_up") for t in near)
    big = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=256, GROUP_M=8, num_warps=8, num_stages=3)
    assert not moe_tune.fits(big, matmul == "gate_up")  # 3 stages of 128x256 + 256x256 bf16 tiles: 576 KiB
    fp8_grid = moe_tune.coarse_grid(16, matmul, quick=False, fp8=True)  # FP8 experts: one scale group a step at most
    assert fp8_grid and all(128 % t["BLOCK_K"] == 0 for t in fp8_grid)


@needs_triton_interpreter
@pytest.mark.parametrize("fp8", [False, True], ids=["experts in the model's dtype", "fp8 experts"])
def test_the_tuner_runs_under_the_interpreter_and_writes_a_table_the_engine_loads(tmp_path, fp8):
    """`--fp8`: a table under the FP8 experts' key, whose entries the engine's FP8 experts read (their BLOCK_K
    divides 128)."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_tune.py"), "--preset", "tiny-moe", "--quick",
                          "--token-counts", "1,40", "--commit", "test", "--out", str(tmp_path)] + (["--fp8"] * fp8),
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    figures = json.loads((tmp_path / "moe_tune.json").read_text())
    assert figures["environment"]["commit"] == "test"
    args = moe_tune.moe_args_of("tiny-moe")
    key = shape_key(args.num_experts, args.top_k, args.hidden_size, args.intermediate_size,
                    torch.float8_e4m3fn if fp8 else torch.float32)
    table = TileTable.load(tmp_path / "moe_tiles.json", key, args.top_k, args.num_experts, "test", fp8)
    assert table.counts == [1, 40]
    for n in (1, 40):
        assert figures["by_num_tokens"][str(n)]["agrees_with_rule"]
        quick = [t for m in moe_tune.block_ms(n, args) for t in moe_tune.coarse_grid(m, "down", quick=True)]
        quick.append(rule_tiles(n, args.top_k, args.num_experts, fp8))
        assert all(tiles in quick for tiles in table.tiles(n))
        assert figures["by_num_tokens"][str(n)]["down"]["bytes"] > 0
