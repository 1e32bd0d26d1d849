"""Context parallelism: the tokens of each packed row split over the ranks of a `cp` group.

Applied from outside the model: the trainer shards each row after reading it, and the model's
attention backend (`backend.attend(layer_idx, q, k, v)`) becomes `RingAttention`, which passes
k and v around the group and merges the partial results with their log-sum-exp (a latent-attention
model's becomes `latent_context_parallel.LatentContextAttention`, which gathers the row's latents). Everything
else in a block is per token, so the model code does not know its tokens are a shard.

Invariants:
- The ranks of a `cp` group train the same rows: each contributes its row files (or fake rows),
  all of them are gathered, and every rank keeps its shard of every row. The loss tokens of all
  ranks together are the loss tokens of the step, once each, so the loss normalization (sum over
  loss tokens / the step's loss tokens, FSDP averaging over all ranks) is CP = 1's.
- Zigzag sharding balances the causal work: a row padded to a multiple of 2 x cp is cut into
  2 x cp chunks and rank r holds chunks r and 2 cp - 1 - r (one early, one late chunk).
- Position ids travel with the tokens (RoPE is per token) and document ids are taken from the
  whole row, so packed documents never attend across each other.
- Token t is predicted from the hidden state at t - 1, which may live on another rank: the
  per-token fields of the loss (targets, loss mask, logprobs, advantages, temperatures) are
  shifted by one before sharding, so position j of a shard holds what the model predicts there.
- Padding tokens form their own document at the end of the row, carry no loss, and come after
  every real token, so causal attention never lets a real token see them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from tandem.models.attention import DocumentCausalAttention, document_ids
from tandem.models.loading import has_split_blocks, is_native

from tandem.trainer.micro_batch import ContextShard, MicroBatch, zigzag_indices

if TYPE_CHECKING:
    from tandem.transport.types import PackedRow


def gather_group_rows(rows: list[PackedRow], group: dist.ProcessGroup) -> list[PackedRow]:
    """The rows of every rank of the `cp` group, in group rank order: the rows the whole group trains."""
    gathered: list[list[PackedRow] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, rows, group=group)
    return [row for part in gathered for row in part]


def shard_micro_batch(mb: MicroBatch, group: dist.ProcessGroup) -> MicroBatch:
    """This rank's zigzag shard of a one-row micro-batch, with the loss fields shifted onto the predicting position."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if mb.input_ids.shape[0] != 1:
        raise ValueError(f"context parallelism shards one row per micro-batch, got {mb.input_ids.shape[0]}")
    length = mb.num_tokens
    padded = math.ceil(length / (2 * size)) * 2 * size
    pad = padded - length
    device = mb.input_ids.device
    positions = torch.cat([mb.position_ids, torch.arange(pad, device=device)[None]], dim=1)
    index = zigzag_indices(padded, size, rank, device)

    def shifted(t: torch.Tensor) -> torch.Tensor:  # value of token t + 1 at position t; the pad after the row is 0
        return torch.cat([t[:, 1:], t.new_zeros(1, pad + 1)], dim=1)[:, index]

    routed = None
    if mb.routed_experts is not None:
        routed = torch.cat([mb.routed_experts, mb.routed_experts.new_full((pad, *mb.routed_experts.shape[1:]), -1)])[index]
    temperatures = shifted(mb.temperatures)
    shard = ContextShard(group=group, size=size, rank=rank, row_document_ids=document_ids(positions)[0],
                         row_document_lengths=mb.row_document_lengths[0] + ([pad] if pad else []),
                         targets=shifted(mb.input_ids), num_real=length)
    return dataclasses.replace(
        mb, input_ids=torch.cat([mb.input_ids, mb.input_ids.new_zeros(1, pad)], dim=1)[:, index], position_ids=positions[:, index], loss_mask=shifted(mb.loss_mask),
        inference_logprobs=shifted(mb.inference_logprobs), advantages=shifted(mb.advantages),
        temperatures=torch.where(temperatures > 0, temperatures, 1.0), on_policy=shifted(mb.on_policy),
        row_document_lengths=None, routed_experts=routed, context=shard, predicting_positions=None)


def start_ring_shift(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> Callable[[], list[torch.Tensor]]:
    """Start sending each tensor to the next rank of the group and receiving the previous rank's;
    the returned function waits and gives the received tensors (the caller computes meanwhile)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    send_to, recv_from = (dist.get_global_rank(group, (rank + d) % size) for d in (1, -1))
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), send_to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, recv_from, group) for r in received]
    works = dist.batch_isend_irecv(ops)

    def finish() -> list[torch.Tensor]:
        for work in works:
            work.wait()
        return received

    return finish


class RingAttention:
    """Attention backend of a context-parallel shard: causal within each document of the whole row.

    Step s of the ring attends the local queries to the k/v of shard (rank - s) mod cp, then k/v
    move one rank on; backward walks the ring again, and the k/v gradients travel with their k/v
    until they are home. Queries go in chunks of `query_chunk`, so a step holds chunk x T_local
    scores per head, not T_local^2; a chunk that precedes every key it is shown is skipped (the
    causal half of the zigzag blocks). Masks come from global token indices and document ids.
    """

    def __init__(self, shard: ContextShard, query_chunk: int):
        self.shard = shard
        self.query_chunk = query_chunk
        doc = shard.row_document_ids
        self.q_index = shard.token_index(shard.rank)
        self.q_doc = doc[self.q_index]
        self.k_index = [shard.token_index((shard.rank - s) % shard.size) for s in range(shard.size)]
        self.k_doc = [doc[index] for index in self.k_index]
        # On the host: zigzag indices are known without reading the device.
        length = doc.numel()
        self.q_host = zigzag_indices(length, shard.size, shard.rank)
        self.first_key = [int(zigzag_indices(length, shard.size, (shard.rank - s) % shard.size).min()) for s in range(shard.size)]

    def mask(self, step: int, start: int, end: int) -> torch.Tensor | None:
        """[end - start, T_local] bool: which keys of ring step `step` queries start:end see; None for none."""
        if int(self.q_host[start:end].max()) < self.first_key[step]:
            return None
        q_index, q_doc = self.q_index[start:end], self.q_doc[start:end]
        return (q_doc[:, None] == self.k_doc[step][None, :]) & (q_index[:, None] >= self.k_index[step][None, :])

    def chunks(self, step: int, num_queries: int):
        """(start, end, mask) of each query chunk that sees keys at ring step `step`."""
        for start in range(0, num_queries, self.query_chunk):
            end = min(start + self.query_chunk, num_queries)
            mask = self.mask(step, start, end)
            if mask is not None:
                yield start, end, mask

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, self)


class UlyssesAttention:
    """Attention backend of a context-parallel shard through all-to-alls over heads (DeepSpeed-Ulysses).

    An all-to-all turns this rank's tokens of every head into every token of 1/cp of the heads
    (each rank's q heads and the k/v heads they share: the key/value heads must divide by cp);
    the tokens go back into row order and the single-device backend (`DocumentCausalAttention`:
    the fused kernels on a GPU) attends them over the whole row; a second all-to-all brings each
    rank its tokens back. Both all-to-alls are differentiable.
    """

    def __init__(self, shard: ContextShard, sdpa_backends: list[str]):
        self.shard = shard
        gathered = torch.cat([shard.token_index(r) for r in range(shard.size)])  # row index of each gathered token
        self.gathered_index = gathered
        self.row_order = torch.argsort(gathered)
        self.row = DocumentCausalAttention([shard.row_document_lengths], shard.row_document_ids.device, sdpa_backends)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.row.attend(layer_idx, *(self._to_heads(x) for x in (q, k, v)))
        return self._to_tokens(out)

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[1, T_local, H, D] (this rank's tokens) -> [1, T_padded, H / cp, D] (every token, in row order)."""
        _, T, H, D = x.shape
        cp = self.shard.size
        parts = x[0].view(T, cp, H // cp, D).transpose(0, 1).contiguous()  # [cp, T, H / cp, D]: head group r to rank r
        received = all_to_all_single_autograd(parts.view(cp * T, H // cp, D), None, None, self.shard.group)
        return received[self.row_order][None]

    def _to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[1, T_padded, H / cp, D] in row order -> [1, T_local, H, D] (this rank's tokens, all heads)."""
        _, _, h, D = x.shape
        cp = self.shard.size
        parts = x[0][self.gathered_index].contiguous()  # rank r's tokens to rank r
        received = all_to_all_single_autograd(parts, None, None, self.shard.group)
        T = received.shape[0] // cp
        return received.view(cp, T, h, D).transpose(0, 1).reshape(1, T, cp * h, D)


def context_attention(shard: ContextShard, kind: str, query_chunk: int,
                      sdpa_backends: list[str]) -> RingAttention | UlyssesAttention:
    """The attention backend of a shard: `parallel.cp_attention` = `ring` or `ulysses`."""
    if kind == "ring":
        return RingAttention(shard, query_chunk)
    if kind == "ulysses":
        return UlyssesAttention(shard, sdpa_backends)
    raise ValueError(f"unknown `parallel.cp_attention` {kind!r}; choose 'ring' or 'ulysses'")


def check_context_parallel(cp: int, attention: str, hf_config: dict, source: str) -> None:
    """Ulysses splits the key/value heads over the `cp` ranks: they must divide, and the model must have them
    (checked from config.json)."""
    if cp == 1 or attention != "ulysses":
        return
    if is_native(hf_config) and not has_split_blocks(hf_config):
        raise ValueError(f"`parallel.cp_attention` = 'ulysses' splits key/value heads over the `parallel.cp` ranks, but "
                         f"{source} has model_type {hf_config['model_type']!r} (latent attention: one latent entry a "
                         "token, shared by every head, which context parallelism gathers from the ranks instead); "
                         "use `parallel.cp_attention` = 'ring'")
    kv_heads = hf_config.get("num_key_value_heads") or hf_config.get("num_attention_heads")
    if kv_heads is not None and kv_heads % cp:
        raise ValueError(f"`parallel.cp` = {cp} with `parallel.cp_attention` = 'ulysses' splits the key/value heads, but "
                         f"`num_key_value_heads` = {kv_heads} in {source} does not divide by it; use `parallel.cp_attention` "
                         f"= 'ring' or a `parallel.cp` dividing {kv_heads}")


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, T, Hq, D] -> [B, Hkv, G, T, D] fp32 (G query heads share one k/v head)."""
    B, T, H, D = q.shape
    return q.float().view(B, T, num_kv_heads, H // num_kv_heads, D).permute(0, 2, 3, 1, 4)


def _ungrouped(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Hkv, G, T, D] -> [B, T, Hkv * G, D] in `dtype`."""
    B, Hkv, G, T, D = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(B, T, Hkv * G, D).to(dtype)


def _kv(x: torch.Tensor) -> torch.Tensor:
    """[B, T, Hkv, D] -> [B, Hkv, 1, T, D] fp32."""
    return x.float().transpose(1, 2)[:, :, None]


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a query that has seen no key yet) replaced by 0, so exp(score - lse) stays finite."""
    return torch.where(torch.isfinite(lse), lse, 0.0)


class _RingAttention(torch.autograd.Function):
    """FlashAttention's recurrence over the ring's k/v blocks, in fp32, with its own backward."""

    @staticmethod
    def forward(ctx, q, k, v, ring):
        group, scale = ring.shard.group, 1.0 / math.sqrt(q.shape[-1])
        qg = _grouped(q, k.shape[2])
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], -math.inf, device=q.device)
        k_block, v_block, pending = k, v, None
        for s in range(ring.shard.size):
            if s:
                k_block, v_block = pending()
            if s < ring.shard.size - 1:  # the next block travels while this one is computed
                pending = start_ring_shift([k_block, v_block], group)
            kb, vb = _kv(k_block), _kv(v_block)
            for start, end, mask in ring.chunks(s, qg.shape[-2]):
                scores = torch.matmul(qg[..., start:end, :], kb.transpose(-1, -2)) * scale
                old = lse[..., start:end]
                new = torch.logaddexp(old, torch.logsumexp(scores.masked_fill(~mask, -math.inf), dim=-1))
                probs = torch.where(mask, torch.exp(scores - _finite(new)[..., None]), 0.0)
                keep = torch.where(torch.isfinite(new), torch.exp(old - _finite(new)), 0.0)
                out[..., start:end, :] = out[..., start:end, :] * keep[..., None] + torch.matmul(probs, vb)
                lse[..., start:end] = new
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return _ungrouped(out, q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        qg = _grouped(q, k.shape[2])
        grad = _grouped(grad_out, k.shape[2])
        delta = (grad * out).sum(-1, keepdim=True)  # rowsum(dO * O)
        grad_q = torch.zeros_like(qg)
        group, k_block, v_block, pending = ring.shard.group, k, v, None
        grad_k = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # travel with k_block, v_block
        grad_v = torch.zeros_like(grad_k)
        for s in range(ring.shard.size):
            if s:  # the gradients of a block follow it once they hold this rank's part
                k_block, v_block = pending()
                grad_k, grad_v = start_ring_shift([grad_k, grad_v], group)()
            if s < ring.shard.size - 1:
                pending = start_ring_shift([k_block, v_block], group)
            kb, vb = _kv(k_block), _kv(v_block)
            for start, end, mask in ring.chunks(s, qg.shape[-2]):
                qc, gc = qg[..., start:end, :], grad[..., start:end, :]
                scores = torch.matmul(qc, kb.transpose(-1, -2)) * scale
                probs = torch.where(mask, torch.exp(scores - _finite(lse[..., start:end])[..., None]), 0.0)
                grad_scores = probs * (torch.matmul(gc, vb.transpose(-1, -2)) - delta[..., start:end, :])
                grad_q[..., start:end, :] += torch.matmul(grad_scores, kb) * scale
                # summed over the G query heads of each k/v head: [B, Hkv, Tk, D] -> [B, Tk, Hkv, D]
                grad_k += (torch.matmul(grad_scores.transpose(-1, -2), qc) * scale).sum(2).transpose(1, 2)
                grad_v += torch.matmul(probs.transpose(-1, -2), gc).sum(2).transpose(1, 2)
        if ring.shard.size > 1:  # the gradients of the last block held go one rank on: home
            grad_k, grad_v = start_ring_shift([grad_k, grad_v], group)()
        return _ungrouped(grad_q, q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None
