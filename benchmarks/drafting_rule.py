"""Host time of the n-gram drafting rule (`NgramProposer.worth_drafting`) per step, on the CPU, no model.

    python benchmarks/drafting_rule.py --sequences 64 --steps 256

Each decoding sequence starts from a random prompt and gains one token a step, as in an engine's decode steps:
random tokens of a Qwen3-sized vocabulary (`random`: lookup never guesses, the rule declines) or a short loop
(`loop`: greedy random weights fall into these, the rule drafts). Reported per kind: the mean and median
milliseconds of the rule per step (the first step, which indexes the prompts, apart), and how many steps drafted.
A step's rule time is host time an overlapped engine spends before it launches the step.

`verifying`: steps that verify drafts, as in loops: each step the rule and `propose` (k drafts a sequence) run
after the previous step is read, `NgramProposer.observe` while the step computes (its forward launched); each
draft is accepted with probability `--acceptance` up to the first that is not, then one more token of the loop
comes. Reported: milliseconds per step after the read (what a verifying step's device waits for) and before it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.scheduler import ScheduledBatch
from tandem.inference.engine.sequence import Sequence
from tandem.inference.engine.speculative import NgramProposer

VOCAB_SIZE = 151_936
"""Qwen3's vocabulary: random tokens of it almost never repeat within a sequence."""


def decoding_sequences(rng: random.Random, num_seqs: int, prompt_tokens: int, max_tokens: int) -> list[Sequence]:
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(str(i), 0, [rng.randrange(VOCAB_SIZE) for _ in range(prompt_tokens)], SamplingParams(max_tokens=max_tokens), None)
        seq.num_computed_tokens = prompt_tokens  # decoding: its prompt is in the cache
        seqs.append(seq)
    return seqs


def measure(kind: str, num_seqs: int, num_steps: int, prompt_tokens: int, loop_tokens: int, num_drafts: int) -> dict:
    rng = random.Random(0)
    seqs = decoding_sequences(rng, num_seqs, prompt_tokens, num_steps)
    loops = [[rng.randrange(VOCAB_SIZE) for _ in range(loop_tokens)] for _ in seqs]
    rule = NgramProposer(ngram_max=4, min_expected_tokens=0.5)
    seconds, drafted = [], 0
    for step in range(num_steps):
        for seq, loop in zip(seqs, loops):
            seq.token_ids.append(rng.randrange(VOCAB_SIZE) if kind == "random" else loop[step % loop_tokens])
            seq.num_computed_tokens += 1
        start = time.thread_time()
        drafted += rule.worth_drafting(seqs, num_drafts)
        seconds.append(time.thread_time() - start)
    ms = [1e3 * s for s in seconds]
    return {"first_step_ms": ms[0], "mean_ms": statistics.mean(ms[1:]), "median_ms": statistics.median(ms[1:]),
            "drafting_steps": drafted, "steps": num_steps}


def measure_verifying(num_seqs: int, num_steps: int, prompt_tokens: int, loop_tokens: int, num_drafts: int,
                      acceptance: float) -> dict:
    rng = random.Random(0)
    seqs = decoding_sequences(rng, num_seqs, prompt_tokens, num_steps * (num_drafts + 1))
    loops = [[rng.randrange(VOCAB_SIZE) for _ in range(loop_tokens)] for _ in seqs]
    rule = NgramProposer(ngram_max=4, min_expected_tokens=0.5)
    after, before, drafted, accepted = [], [], 0, 0
    for step in range(num_steps):
        start = time.thread_time()
        drafting = rule.worth_drafting(seqs, num_drafts)
        batch = ScheduledBatch()
        for seq in seqs:
            batch.add(seq, 1, num_drafts if drafting else 0)
        rule.propose(batch)
        after.append(time.thread_time() - start)
        start = time.thread_time()
        rule.observe(batch)
        before.append(time.thread_time() - start)
        for seq, loop, drafts in zip(seqs, loops, batch.drafts):
            num_accepted = 0
            while num_accepted < len(drafts) and rng.random() < acceptance:
                num_accepted += 1
            drafted, accepted = drafted + len(drafts), accepted + num_accepted
            seq.token_ids += drafts[:num_accepted] + [loop[seq.num_completion_tokens % loop_tokens]]
            seq.num_computed_tokens = len(seq.token_ids) - 1
    after_ms, before_ms = [1e3 * s for s in after[1:]], [1e3 * s for s in before[1:]]
    return {"after_read_mean_ms": statistics.mean(after_ms), "after_read_median_ms": statistics.median(after_ms),
            "before_read_mean_ms": statistics.mean(before_ms), "before_read_median_ms": statistics.median(before_ms),
            "drafted": drafted, "accepted": accepted, "steps": num_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--loop-tokens", type=int, default=7)
    parser.add_argument("--num-drafts", type=int, default=4, help="k")
    parser.add_argument("--acceptance", type=float, default=0.84,
                        help="`verifying`: a draft's chance to be accepted where the one before was (0.84: about two "
                             "thirds of k = 4 drafts accepted)")
    args = parser.parse_args()
    results = {kind: measure(kind, args.sequences, args.steps, args.prompt_tokens, args.loop_tokens, args.num_drafts)
               for kind in ("random", "loop")}
    results["verifying"] = measure_verifying(args.sequences, args.steps, args.prompt_tokens, args.loop_tokens,
                                             args.num_drafts, args.acceptance)
    print(json.dumps({"settings": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
