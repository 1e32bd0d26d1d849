"""Run under torchrun by `test_context_parallel.py`: one RL forward/backward of the same global batch of
packed rows (several documents of odd lengths, mixed temperatures) at each context-parallel size
(and expert-parallel size) given; rank 0 saves the global loss, entropy, full gradients and norm, and for a
mixture of experts the router statistics (which must not count the padding CP adds to a row).
For a mixture of experts the completion tokens replay given experts (router replay), the prompt
tokens route themselves: a replay misaligned with its tokens would change the loss.

    torchrun --nproc-per-node 4 tests/trainer/cp_gradients.py OUT.pt MODEL_FOLDER CP:EP[:ATTENTION] ... [MODEL_FOLDER ...]

(ATTENTION: `parallel.cp_attention`, ring by default.) Results are keyed by folder, then by those strings: one
launch serves several models (each start of 4 ranks importing torch costs seconds of the CI's 2 cores).
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.distributed.tensor import DTensor

from tandem.config.base import ModelConfig
from tandem.config.trainer import AIPOLoss, KernelsConfig, ParallelConfig
from tandem.trainer.batch import prepare_micro_batches
from tandem.trainer.loss import build_loss
from tandem.trainer.model import build_policy
from tandem.trainer.parallel.dims import close_parallel, init_parallel
from tandem.trainer.rl.train import rl_objective
from tandem.trainer.parallel.expert_parallel import moe_blocks
from tandem.trainer.step import clip_grad_norm, forward_objective, global_sum, maybe_replayed_routing
from tandem.transport.types import PackedRow

DOCUMENTS = [[11, 5, 21], [7, 19], [3, 13, 9, 1], [29]]
"""Document lengths of each rank's row (rows of 37, 26, 26 and 29 tokens: none a multiple of 2 x 4)."""


def packed_row(lengths: list[int], seed: int, vocab_size: int, moe: tuple[int, int, int] | None) -> PackedRow:
    """Documents of half prompt, half completion; completions carry logprobs, advantages, temperature 0.7
    and, with `moe` = (MoE layers, experts, k), the experts to replay."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (sum(lengths),), generator=gen).tolist()
    positions, mask, advantages, temperatures = [], [], [], []
    for n in lengths:
        prompt = (n + 1) // 2
        advantage = float(torch.randn(1, generator=gen))
        positions += list(range(n))
        mask += [0] * prompt + [1] * (n - prompt)
        advantages += [0.0] * prompt + [advantage] * (n - prompt)
        temperatures += [1.0] * prompt + [0.7] * (n - prompt)
    logprobs = [-5.0 + 0.1 * (t % 7) if m else 0.0 for t, m in enumerate(mask)]
    routed = []
    if moe is not None:
        layers, experts, k = moe
        routed = [[torch.randperm(experts, generator=gen)[:k].tolist() for _ in range(layers)] if m else []
                  for m in mask]
    return PackedRow(ids, positions, mask, logprobs, advantages, temperatures, routed_experts=routed)


def gradients_at(folder: str, cp: int, ep: int, attention: str) -> dict:
    dims = init_parallel("cpu", ep, cp)
    parallel = ParallelConfig(cp=cp, ep=ep, cp_attention=attention, cp_query_chunk=4)
    policy, hf_config = build_policy(ModelConfig(name=folder), parallel, dims, 16, KernelsConfig(compile="off"))
    moes = moe_blocks(policy.blocks)
    moe = (len(moes), moes[0].args.num_experts, moes[0].args.top_k) if moes else None
    rows = [packed_row(lengths, seed, hf_config["vocab_size"], moe) for seed, lengths in enumerate(DOCUMENTS)]
    num_loss_tokens = sum(sum(row.loss_mask) for row in rows)
    objective = rl_objective(build_loss(AIPOLoss()))
    loss = entropy = 0.0
    micro_batches = prepare_micro_batches([rows[dims.rank]], dims, policy_version=0, router_replay=moe is not None)
    if policy.router is not None:
        policy.router.begin_step(len(micro_batches))
    for mb in micro_batches:
        with maybe_replayed_routing(policy, mb):
            with policy.router.collecting(mb.context.real_tokens() if mb.context else None) if moe else contextlib.nullcontext():
                result, entropy_sum = forward_objective(policy, mb, objective)
            (result.loss_sum * dims.dp_size / num_loss_tokens).backward()
        loss += float(result.loss_sum.detach())
        entropy += float(entropy_sum)
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for name, p in policy.named_parameters() if p.grad is not None}
    loss, entropy = global_sum([loss, entropy], dims)
    router = policy.router.end_step(update_bias=False) if policy.router is not None else None
    return {"loss": loss / num_loss_tokens, "entropy": entropy / num_loss_tokens,
            "grad_norm": float(clip_grad_norm(policy.parameters(), 0.0)), "grads": grads, "rank": dims.rank, "router": router}


def main(out: str, *args: str) -> None:
    results, rank = {}, None
    for arg in args:
        if ":" not in arg:  # a model folder; the sizes that follow are its own
            folder = arg
            results[folder] = {}
            continue
        cp, ep, *attention = arg.split(":")
        results[folder][arg] = run = gradients_at(folder, int(cp), int(ep), attention[0] if attention else "ring")
        rank = run["rank"]
    if rank == 0:
        torch.save(results, out)
    close_parallel(wait_for_peers=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
