"""The trainer's side of `lora.share_base`, as a process of its own for tests: build the LoRA policy with its base
in the shared buffer, publish it in the run folder, print the file's path, and hold the base until stdin closes.

    python shared_base_trainer.py <model folder> <run folder> <lora keys as JSON> <cpu | cuda> [<load format>]

Its model dtype is `auto` (bf16 on CUDA) on CUDA, fp32 on the CPU, as the engine's in the tests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tandem.config.base import ModelConfig
from tandem.config.lora import LoraConfig
from tandem.config.trainer import ParallelConfig
from tandem.trainer.model import build_policy
from tandem.trainer.parallel.dims import close_parallel, init_parallel


def main(model: str, run_dir: str, lora: str, device: str, load_format: str = "safetensors") -> None:
    dims = init_parallel(device)
    try:
        dtype = "float32" if device == "cpu" else "auto"
        policy, _ = build_policy(ModelConfig(name=model, dtype=dtype, load_format=load_format), ParallelConfig(), dims,
                                 chunk_size=64, lora=LoraConfig(**json.loads(lora), share_base=True))
        print(policy.shared_base.publish(Path(run_dir)), flush=True)
        sys.stdin.read()
        policy.shared_base.buffer.remove()
    finally:
        close_parallel()


if __name__ == "__main__":
    main(*sys.argv[1:])
