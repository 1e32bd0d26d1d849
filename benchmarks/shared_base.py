"""An engine over the trainer's shared base (`lora.share_base`) against one with its own merged copy, on one GPU:
the engine process's own memory and the decode speed the low-rank side path costs.

    python benchmarks/shared_base.py --preset qwen3-4b --num-layers 8 --out $OUT/shared-base.json

A trainer's process (`tests/inference/shared_base_trainer.py`: the trainer's `build_policy` with the base in one
CUDA allocation, random weights of the preset's shape) holds the base; in this process an engine maps it, and then,
that one dropped, an engine loads its own copy and merges the same adapters. Each generates `--batch` sequences of
`--tokens` tokens (decode steps replayed from CUDA graphs) after one warm-up round; figures: the engine's own
device allocation after it is built (weights, KV cache, graphs), and tokens per second of the timed round.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from provenance import environment, source_commit
from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.models.presets import PRESETS, init_model

HOLDER = Path(__file__).resolve().parent.parent / "tests" / "inference" / "shared_base_trainer.py"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default="qwen3-4b")
    parser.add_argument("--num-layers", type=int, help="cut the preset to this many blocks")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks of 16 tokens (the same for both)")
    parser.add_argument("--out", help="write the figures to this JSON file")
    parser.add_argument("--commit", help="the commit measured (default: git's HEAD)")
    return parser.parse_args()


def adapters(engine, rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    state = {}
    for name, module in engine.runner.model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            state[f"{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen) * 0.01
            state[f"{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=gen) * 0.01
    return state


def generate(engine, batch: int, tokens: int) -> float:
    """Seconds to generate `batch` sequences of `tokens` tokens after 8-token prompts."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(batch):
        engine.add_request(str(i), [1 + (i + j) % 100 for j in range(8)],
                           SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=i))
    while engine.has_unfinished:
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(args, model: Path, lora: dict, shared: Path | None) -> dict:
    config = EngineConfig(device="cuda", num_blocks=args.num_blocks, max_model_len=1024, max_num_seqs=args.batch,
                          lora={**lora, "share_base": shared is not None})
    before = torch.cuda.memory_allocated()
    engine = build_engine(ModelConfig(name=str(model), load_format="dummy"), config, seed=0, shared_base=shared)
    own_gib = (torch.cuda.memory_allocated() - before) / 2**30
    engine.update_weights(adapters(engine, args.rank), 1)
    generate(engine, args.batch, 8)
    seconds = generate(engine, args.batch, args.tokens)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return {"engine_own_gib": own_gib, "seconds": seconds, "tokens_per_s": args.batch * args.tokens / seconds}


def main() -> int:
    args = parse_args()
    lora = {"enabled": True, "rank": args.rank, "alpha": 2.0 * args.rank, "target_modules": TARGETS}
    with tempfile.TemporaryDirectory(prefix="shared-base-") as tmp:
        model = init_model(args.preset, Path(tmp) / "model", num_layers=args.num_layers, weights=False)
        holder = subprocess.Popen([sys.executable, str(HOLDER), str(model), tmp, json.dumps(lora), "cuda", "dummy"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            path = Path(holder.stdout.readline().strip())
            if not path.is_file():
                raise RuntimeError(f"the trainer's process exited with {holder.poll()}")
            result = {"benchmark": "shared_base", "commit": source_commit(args.commit), "settings": vars(args),
                      "shared": measure(args, model, lora, path), "own_copy": measure(args, model, lora, None)}
        finally:
            holder.stdin.close()
            holder.wait(60)
    result["decode_time_ratio"] = result["shared"]["seconds"] / result["own_copy"]["seconds"]
    result["environment"] = environment(torch.device("cuda"), args.commit)
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
