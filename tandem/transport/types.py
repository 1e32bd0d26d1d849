"""Wire types between orchestrator and trainer. The single definition both sides import.

Producer: the orchestrator packs scored rollouts into `TrainingBatch`es, one file per trainer
rank and step (`rollouts/step_N/rank_R.msgpack`). Consumer: the trainer.

Token alignment inside a `PackedRow`: position t describes token `input_ids[t]`.
`loss_mask[t]` is 1 when the model sampled that token, `logprobs[t]` is the logprob the inference
server reported for it (0 where not sampled), `advantages[t]` its advantage and `temperatures[t]`
the sampling temperature used (the trainer divides logits by it before the log-softmax), and
`policy_versions[t]` the policy version that sampled the sample holding token t (its oldest
turn; -1 in padding), so the trainer can tell on-policy tokens from off-policy ones. The
trainer predicts token t from the logits at t-1, so the first token of a sample is never a loss
token. `position_ids` restart at 0 at each packed sample: attention never crosses samples.
"""

from __future__ import annotations

import msgspec


class PackedRow(msgspec.Struct, array_like=True):
    """One micro-batch: samples packed into at most `seq_len` tokens."""

    input_ids: list[int]
    position_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    advantages: list[float]
    temperatures: list[float]
    policy_versions: list[int] = []
    """Empty when unknown (SFT and fake data): every token then counts as on-policy."""
    routed_experts: list[list[list[int]]] = []
    """Router replay: empty (no replay), or per token t the [MoE layer][k] expert ids the inference
    server's forward at t used when it sampled token t + 1, and [] where it reported none (prompt
    tokens: the trainer routes those itself). From `/v1/generate` with `return_routed_experts`."""


class TrainingBatch(msgspec.Struct):
    """All micro-batches of one trainer rank for one step.

    Every rank of a step receives the same number of rows (the orchestrator pads with rows whose
    `loss_mask` is all zero), because FSDP's collectives need every rank to run the same number
    of forward/backward passes. `num_loss_tokens` is the global count over all ranks, the
    denominator of the token-level loss.
    """

    step: int
    rank: int
    rows: list[PackedRow]
    num_loss_tokens: int
    policy_versions: list[int] = []
    """Policy version of each sample in this file (for logging the off-policy gap)."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TrainingBatch)


def encode_batch(batch: TrainingBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(data: bytes) -> TrainingBatch:
    return _decoder.decode(data)
