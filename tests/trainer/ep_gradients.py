"""Run under torchrun by `test_expert_parallel.py`: one RL forward/backward of the same global batch at
each expert-parallel size dividing the world size; rank 0 saves the losses, full gradients and norms,
and the full state that published weights are made of.

    torchrun --nproc-per-node 4 tests/trainer/ep_gradients.py OUT.pt MODEL_FOLDER ...

Results are keyed by folder: one launch serves several models (each start of 4 ranks importing torch costs
seconds of the CI's 2 cores). `main` takes the arguments as a list, so that torchrun_commands.py can run it as one
step of a launch.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.distributed.tensor import DTensor

from tandem.config.base import ModelConfig
from tandem.config.trainer import AIPOLoss, KernelsConfig, ParallelConfig, RolloutDataConfig
from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.data import fake_batch
from tandem.trainer.loss import build_loss
from tandem.trainer.model import build_policy, gather_full_state
from tandem.trainer.parallel.dims import close_parallel, init_parallel
from tandem.trainer.rl.train import rl_objective
from tandem.trainer.step import clip_grad_norm, forward_objective, global_sum


def gradients_at(folder: str, ep: int) -> dict:
    dims = init_parallel("cpu", ep)
    policy, _ = build_policy(ModelConfig(name=folder), ParallelConfig(ep=ep), dims, 64, KernelsConfig(compile="off"))
    batch = fake_batch(1, dims.rank, dims.world_size, RolloutDataConfig(fake=True, fake_rows=dims.world_size, fake_samples_per_row=2),
                       32, 260, seed=0)
    objective = rl_objective(build_loss(AIPOLoss()))
    loss = 0.0
    for row in batch.rows:
        result, _ = forward_objective(policy, MicroBatch.from_row(row, dims.device, policy_version=0), objective)
        (result.loss_sum * dims.dp_size / batch.num_loss_tokens).backward()
        loss += float(result.loss_sum.detach())
    published = gather_full_state(policy, torch.float32, keep=dims.is_main)  # what `weights/step_N/` holds
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for name, p in policy.named_parameters() if p.grad is not None}
    return {"loss": global_sum([loss], dims)[0] / batch.num_loss_tokens, "grad_norm": float(clip_grad_norm(policy.parameters(), 0.0)),
            "grads": grads, "published": published, "rank": dims.rank, "world_size": dims.world_size}


def main(argv: list[str]) -> int:
    out, *folders = argv
    world_size = int(os.environ["WORLD_SIZE"])
    results = {folder: {ep: gradients_at(folder, ep) for ep in (1, 2, 4) if world_size % ep == 0} for folder in folders}
    if results[folders[0]][1]["rank"] == 0:
        torch.save(results, out)
    close_parallel(wait_for_peers=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
