"""The model the trainers train: a causal LM from `tandem/models/` with parallelism applied.

`PolicyModel` wraps the causal LM and computes per-token logprobs inside its own `forward`, so
the LM head runs inside the FSDP root's forward, where its (gathered) weight is valid. Native
models attend through `DocumentCausalAttention` (document lengths from the batch, no mask) and
run the trainer's block forward (`tandem.trainer.block`: compiled halves, selective recompute).

Loading (`build_policy`):
- native models (`tandem.models.loading.NATIVE`): built on the meta device, the training block forward (decoder
  blocks only: latent-attention blocks run whole, `tandem.models.glm_moe_dsa`), activation checkpointing, expert parallelism (`parallel.ep` > 1) and FSDP applied (at world size 1 the plain
  one-rank path instead: `tandem.trainer.parallel.one_rank`), then `to_empty` on the
  target device, then each rank copies only its shard out of the (memory-mapped) safetensors. No
  rank ever holds the whole model in device memory, so this scales to models larger than one
  device (host memory does hold the experts of a mixture of experts whole while they are
  stacked: `tandem.models.expert_layout`). With `model.load_format = "dummy"` each rank draws each
  full tensor on its device instead (`tandem.models.random_init`, the engine's values too) and
  keeps its shard.
- anything else falls back to transformers' model (`HFCausalLM`), loaded whole on the CPU, then
  sharded; FSDP moves the shards to the device. Packed rows still never attend across samples:
  transformers derives a block-diagonal mask from position ids when no attention mask is given.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from tandem.config.base import ModelConfig
from tandem.config.lora import LoraConfig
from tandem.config.trainer import (ActivationCheckpointConfig, Float8TrainingConfig, KernelsConfig, MultiTokenPredictionConfig,
                                   ParallelConfig, RouterConfig)
from tandem.models.attention import DocumentCausalAttention, document_lengths
from tandem.models.exact import ExactDocumentAttention, apply_exact, check_exact, exact_token_logprobs
from tandem.models.fp8 import weight_values
from tandem.models.glm_moe_dsa import LatentMoeForCausalLM
from tandem.models.hf_fallback import HFCausalLM
from tandem.models.hub import resolve_model_path
from tandem.models.lora import LoraSpec, apply_lora, initial_adapters, is_adapter_name
from tandem.models.loading import (DUMMY_SEED, build_native, check_load_format, has_split_blocks, is_native, read_hf_config,
                                   resolve_dtype)
from tandem.models.moe import fp32_router_parameters
from tandem.models.multi_token import mtp_layers
from tandem.models.random_init import RandomWeights
from tandem.models.weights import load_state_dict
from tandem.trainer.block import apply_training_blocks
from tandem.trainer.logprobs import token_logprobs
from tandem.trainer.parallel.activation_checkpoint import apply_activation_checkpoint
from tandem.trainer.micro_batch import ContextShard
from tandem.trainer.mtp import (MtpLoss, check_mtp_trainable, counted_positions, mtp_loss, register_predict,
                               unfreeze_mtp_layers)
from tandem.trainer.parallel.context_parallel import check_context_parallel, context_attention
from tandem.trainer.parallel.dims import EP, ParallelDims
from tandem.trainer.parallel.expert_parallel import apply_expert_parallel, check_expert_parallel, moe_blocks
from tandem.trainer.parallel.fsdp import apply_fsdp
from tandem.trainer.parallel.latent_context_parallel import LatentContextAttention
from tandem.trainer.parallel.one_rank import OneRank, apply_one_rank
from tandem.trainer.phases import phase
from tandem.trainer.router import RouterMonitor, build_router_monitor
from tandem.trainer.shared_base import SharedBase, place_frozen_base, to_empty_beside
from tandem.trainer.stack import apply_compiled_stack, stack_applies


@dataclass
class TokenLogprobs:
    """Per-token outputs aligned with the input tokens: position t is about token t, 0 where not computed."""

    logprobs: torch.Tensor
    """[B, T] fp32, log p(token t | tokens < t) at temperature `temperatures[t]`."""
    entropy: torch.Tensor
    """[B, T] fp32, entropy of the distribution token t was drawn from (no gradient)."""
    mtp: MtpLoss | None = None
    """The MTP layer's loss on the row (`mtp.train`, `tandem.trainer.mtp`); None when it does not train."""


class PolicyModel(nn.Module):
    def __init__(self, lm: nn.Module, chunk_size: int, compile_head: bool = False,
                 sdpa_backends: list[str] = KernelsConfig().sdpa_backends, exact: bool = False):
        """`compile_head`: compile the logprob head's fp32 work; `sdpa_backends`: see `KernelsConfig`; `exact`:
        the model has `tandem.models.exact.apply_exact`, attention and head follow it (`[run] exact`)."""
        super().__init__()
        self.lm = lm
        self.exact = exact
        self.chunk_size = chunk_size
        self.compile_head = compile_head
        self.sdpa_backends = sdpa_backends
        self.native = not isinstance(lm, HFCausalLM)
        self.router: RouterMonitor | None = None
        """Statistics and load balancing of the MoE routers (None for a dense model)."""
        self.context_parallel = ParallelConfig()
        """`parallel.cp_attention` and `parallel.cp_query_chunk`: how a context-parallel shard attends."""
        self.compiled_stack = False
        """Whether the blocks run as one compiled graph where the batch allows (`tandem.trainer.stack`)."""
        self.one_rank: OneRank | None = None
        """The one-rank path's mixed precision (`tandem.trainer.parallel.one_rank`); None under FSDP or when the
        parameters are already in the compute dtype."""
        self.lora: LoraSpec | None = None
        """The adapters' spec when only LoRA adapters train (`tandem.models.lora`); None for full fine-tuning."""
        self.shared_base: SharedBase | None = None
        """With `lora.share_base`: the buffer that holds the frozen base, which the engine maps (`shared_base.py`)."""
        self.mtp_parameters: list[nn.Parameter] = []
        """The multi-token prediction layer's trainable parameters (`mtp.train`); empty when it stays frozen. The
        gradient clipping keeps them apart from the policy's (`tandem.trainer.step`)."""

    @property
    def blocks(self) -> nn.ModuleList:
        return self.lm.layers

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, temperatures: torch.Tensor,
                loss_mask: torch.Tensor, row_document_lengths: list[list[int]] | None = None,
                context: ContextShard | None = None, predicting_positions: torch.Tensor | None = None) -> TokenLogprobs:
        """All inputs [B, T]; logprobs are computed only where `loss_mask` is true.

        `row_document_lengths`: the lengths of the documents packed in each row, as the host
        knows them from the batch; read from `position_ids` (a device sync) when not given.
        `context`: a context-parallel shard (`tandem.trainer.parallel.context_parallel`): attention
        runs around the ring (a latent model's over the gathered latents: `latent_context_parallel`),
        and `temperatures` and `loss_mask` are already aligned with the predicting position, whose
        target is `context.targets`.
        `predicting_positions`: flat indices into the [B * T] positions of those whose next token is
        a loss token, as the host knows them from the batch (`MicroBatch`); found from `loss_mask`
        (a device sync) when not given.

        Token t is predicted from the hidden state at t-1, so column 0 of a whole row is never
        computed. A row without loss tokens still computes one position (then discarded by the
        mask of the loss) so that every parameter takes part in backward: FSDP's reduce-scatters
        must run on every rank for every micro-batch, padding rows included.
        """
        if context is not None:
            if isinstance(self.lm, LatentMoeForCausalLM):  # its blocks hand their latents to the backend
                attention = LatentContextAttention(context, self.context_parallel.cp_query_chunk, self.lm.args.index_topk)
            else:
                attention = context_attention(context, self.context_parallel.cp_attention,
                                              self.context_parallel.cp_query_chunk, self.sdpa_backends)
            hidden = self.lm(input_ids, position_ids, attention=attention)
            positions = mask_positions(loss_mask)
            with phase("logprobs"):
                return self._logprobs(hidden, context.targets, temperatures, positions, positions)
        if self.native:
            if row_document_lengths is None:
                row_document_lengths = [document_lengths(row) for row in position_ids.tolist()]
            attention = (ExactDocumentAttention(row_document_lengths) if self.exact else
                         DocumentCausalAttention(row_document_lengths, input_ids.device, self.sdpa_backends))
            hidden = self.lm(input_ids, position_ids, attention=attention)
        else:
            hidden = self.lm(input_ids, position_ids)
        if predicting_positions is None:
            predicting_positions = mask_positions(torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], dim=1))
        with phase("logprobs"):
            out = self._logprobs(hidden, input_ids, temperatures, predicting_positions, predicting_positions + 1)
        if self.mtp_parameters:  # a native model on whole rows (`check_mtp_trainable`; its config refuses CP)
            with phase("mtp"):
                counted = counted_positions(position_ids, loss_mask)
                out.mtp = mtp_loss(self.lm, hidden, input_ids, position_ids, counted, mask_positions(counted), attention,
                                   self.chunk_size)
        return out

    def _logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor, predicting: torch.Tensor,
                  predicted: torch.Tensor) -> TokenLogprobs:
        """Logprobs and entropies [B, T] of the tokens at the flat positions `predicted` of `targets` [B, T] (at the
        temperatures of the same positions), predicted from `hidden` [B, T, H] at the flat positions `predicting`;
        zero elsewhere. Selected by index, the rows' shapes are known to the host: no sync."""
        head = self.lm.lm_head
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        inputs = (flat_hidden.index_select(0, predicting), head.weight, head.bias, targets.flatten()[predicted],
                  temperatures.flatten()[predicted])
        if self.exact:
            lp, ent = exact_token_logprobs(*inputs, self.chunk_size)
        else:
            lp, ent = token_logprobs(*inputs, self.chunk_size, self.compile_head)
        zeros = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
        where = torch.unravel_index(predicted, targets.shape)  # not a view of a flat tensor: FSDP hooks the outputs
        return TokenLogprobs(zeros.index_put(where, lp), zeros.index_put(where, ent))

    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        inner = self.lm.hf_model if isinstance(self.lm, HFCausalLM) else self.lm
        return list(inner.named_parameters())

    def hf_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The model's parameters under their Hugging Face names (a tied LM head appears once, as the embedding),
        without LoRA adapters."""
        return [(name, param) for name, param in self._named_parameters() if not is_adapter_name(name)]

    def adapter_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The LoRA adapters' parameters (`<projection>.lora_A.weight`, `.lora_B.weight`); empty without LoRA."""
        return [(name, param) for name, param in self._named_parameters() if is_adapter_name(name)]

    def published_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """What a policy update holds: the adapters with LoRA, else every parameter."""
        return self.adapter_parameters() if self.lora is not None else self.hf_named_parameters()


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """Flat indices of the set elements of `mask` [B, T], or [0] where none is set (see `PolicyModel.forward`).
    The number of them is the device's to tell: a sync."""
    positions = mask.flatten().nonzero().squeeze(1)
    return positions if positions.numel() else positions.new_zeros(1)


def compute_dtype(model: ModelConfig, device: torch.device) -> torch.dtype:
    """The dtype blocks compute in: `model.dtype`, where `auto` is bf16 on CUDA and fp32 on CPU."""
    return resolve_dtype(model.dtype, device)


def should_compile(kernels: KernelsConfig, device: torch.device) -> bool:
    """`kernels.compile`, where `auto` compiles on CUDA only."""
    return kernels.compile == "on" or (kernels.compile == "auto" and device.type == "cuda")


def build_policy(model: ModelConfig, parallel: ParallelConfig, dims: ParallelDims, chunk_size: int,
                 kernels: KernelsConfig = KernelsConfig(), router: RouterConfig = RouterConfig(),
                 exact: bool = False, lora: LoraConfig = LoraConfig(), seed: int = 0,
                 fp8: Float8TrainingConfig = Float8TrainingConfig(),
                 mtp: MultiTokenPredictionConfig = MultiTokenPredictionConfig()) -> tuple[PolicyModel, dict]:
    """Load `model.name`, apply the training blocks (or, `exact`, the batch-invariant ones), LoRA adapters
    (`lora.enabled`: started from `seed`), FP8 projections (`fp8.enabled`; the device is the caller's to check:
    `tandem.trainer.float8.check_float8_device`), the MTP layer's training (`mtp.train`), activation checkpointing,
    expert parallelism, FSDP and the router hooks; returns the model and its config.json."""
    folder = resolve_model_path(model.name)
    hf_config = read_hf_config(folder)
    check_load_format(model.load_format, hf_config)
    if exact:
        check_exact(hf_config, str(folder / "config.json"))
    native = is_native(hf_config)
    if native:
        lm = build_native(hf_config, "meta", torch.float32, source=str(folder / "config.json"))
    else:
        lm = HFCausalLM.from_pretrained(folder, "cpu", torch.float32, model.trust_remote_code)
    compile = should_compile(kernels, dims.device) and not exact
    policy = PolicyModel(lm, chunk_size, compile_head=compile and native, sdpa_backends=kernels.sdpa_backends, exact=exact)
    policy.context_parallel = parallel
    if lora.enabled:
        policy.lora = LoraSpec(lora.rank, lora.alpha, tuple(lora.target_modules), tuple(lora.target_experts))
        apply_lora(lm, policy.lora, source="the trainer's config")
        frozen_dtype = compute_dtype(model, dims.device)  # the base never steps: no fp32 master
        fp32 = fp32_router_parameters(lm)
        for param in lm.parameters():
            if not param.requires_grad and id(param) not in fp32:
                param.data = param.data.to(frozen_dtype)
    if mtp.train:
        check_mtp_trainable(lm, dims.ep_size, str(folder / "config.json"))
        unfreeze_mtp_layers(lm)
    one_rank = dims.world_size == 1 and not parallel.fsdp_at_one_rank
    linear = F.linear
    if fp8.enabled:
        if not has_split_blocks(hf_config):
            kind = "latent attention" if native else "transformers fallback"
            raise ValueError(f"`fp8.enabled` needs decoder blocks split at attention; {folder / 'config.json'} has "
                             f"model_type {hf_config.get('model_type')!r} ({kind}); set `fp8.enabled` = false")
        from tandem.trainer.float8 import apply_float8_training  # torchao, only for FP8 runs

        linear = apply_float8_training(policy.blocks, fp8.recipe, fsdp=not one_rank).linear
    checkpointing = parallel.activation_checkpoint
    if exact:  # the engine's forward, token by token; `selective` needs the training blocks: whole blocks instead
        apply_exact(lm)
        checkpointing = ActivationCheckpointConfig(mode="full") if checkpointing.mode == "selective" else checkpointing
    elif has_split_blocks(hf_config):
        apply_training_blocks(policy.blocks, compile=compile, recompute=checkpointing.mode == "selective", linear=linear)
    elif checkpointing.mode == "selective":  # transformers' and latent-attention blocks are not split at attention
        checkpointing = ActivationCheckpointConfig(mode="full")
    apply_activation_checkpoint(policy.blocks, checkpointing)
    stack = (compile and native and one_rank and kernels.compile_stack and checkpointing.mode in ("selective", "off")
             and stack_applies(policy.blocks))
    if stack:
        apply_compiled_stack(lm, recompute=checkpointing.mode == "selective", linear=linear)
        policy.compiled_stack = True
    check_context_parallel(dims.cp_size, parallel.cp_attention, hf_config, str(folder / "config.json"))
    if dims.cp_size > 1 and not native:
        raise ValueError(f"`parallel.cp` = {dims.cp_size} needs a model tandem runs natively; {folder / 'config.json'} has "
                         f"model_type {hf_config.get('model_type')!r} (transformers fallback); set `parallel.cp` = 1")
    if dims.ep_size > 1:
        apply_expert_parallel_to(policy, hf_config, dims, str(folder / "config.json"))
    if not one_rank:
        # The MTP layers in groups of their own, trained or not: in the root's group (gathered for the whole step) a
        # frozen one would take a whole block's memory on every rank.
        sharded = nn.ModuleList([*policy.blocks, *mtp_layers(lm)])
        apply_fsdp(policy, sharded, dims.mesh, param_dtype=compute_dtype(model, dims.device),
                   reduce_dtype=getattr(torch, parallel.reduce_dtype), reshard_after_forward=parallel.reshard_after_forward,
                   expert_mesh=dims.expert_mesh)
        register_predict(lm)
    if is_native(hf_config):
        if lora.share_base:  # the frozen base straight into the buffer the engine maps: never two copies
            check_base_can_be_shared(hf_config, one_rank, str(folder / "config.json"))
            policy.shared_base = place_frozen_base(lm, policy.hf_named_parameters(), dims.device)
            to_empty_beside(policy, dims.device)
        else:
            policy.to_empty(device=dims.device)
        tied = getattr(lm.args, "tie_word_embeddings", False)
        if tied and one_rank:  # `to_empty` of plain meta tensors makes a new parameter in each module
            lm.lm_head.weight = lm.model.embed_tokens.weight
        if tied and lm.lm_head.weight is not lm.model.embed_tokens.weight:
            raise RuntimeError("moving the model untied the embeddings of a tied model; this torch version needs a re-tie step")
        if model.load_format == "dummy":
            shapes = {name: param.shape for name, param in policy.hf_named_parameters()}
            load_shards(policy, RandomWeights(shapes, DUMMY_SEED, dims.device), source="the dummy weights")
        else:
            load_shards(policy, load_state_dict(folder), source=str(folder))
    elif lora.share_base:
        check_base_can_be_shared(hf_config, one_rank, str(folder / "config.json"))
    elif one_rank:  # FSDP would have moved the shards to the device
        policy.to(dims.device)
    if lora.enabled:
        load_shards(policy, initial_adapters(lm, seed), source="the adapters' start", params=policy.adapter_parameters())
    if one_rank:
        policy.one_rank = apply_one_rank(policy, policy.blocks, compute_dtype(model, dims.device), parallel.reshard_after_forward,
                                         per_block=not stack)
    policy.router = build_router_monitor(policy.blocks, router.aux_loss_coef, router.bias_update_rate, dims.device,
                                         str(folder / "config.json"))
    if mtp.train:  # the parameters as they are now: moving and sharding the model replaced the ones built
        policy.mtp_parameters = [p for p in mtp_layers(lm).parameters() if p.requires_grad]
    return policy.train(), hf_config


def check_base_can_be_shared(hf_config: dict, one_rank: bool, source: str) -> None:
    """`lora.share_base` needs the whole base in one plain buffer of this process: a native model (the engine maps
    tensors by their HF names into its own model) on one rank without FSDP (whose shards and gathered copies live
    elsewhere)."""
    if not is_native(hf_config):
        raise ValueError(f"`lora.share_base` needs a model native to tandem; {source} says model_type "
                         f"{hf_config.get('model_type')!r}, which loads through transformers; set `lora.share_base` = false")
    if not one_rank:
        raise ValueError("`lora.share_base` needs the trainer on one rank without FSDP (`parallel.fsdp_at_one_rank` = "
                         "false, one device): a sharded base is not one tensor per weight; set `lora.share_base` = false")


def apply_expert_parallel_to(policy: PolicyModel, hf_config: dict, dims: ParallelDims, source: str) -> None:
    """`parallel.ep` > 1: split the routed experts of a native MoE model over the `ep` axis."""
    check_expert_parallel(dims.ep_size, hf_config, source)
    if not policy.native or not moe_blocks(policy.blocks):
        raise ValueError(f"`parallel.ep` = {dims.ep_size} needs a mixture of experts tandem runs natively; {source} has "
                         f"model_type {hf_config.get('model_type')!r} (transformers fallback); set `parallel.ep` = 1")
    apply_expert_parallel(policy.blocks, dims.expert_mesh[EP])


def load_shards(policy: PolicyModel, state: Mapping[str, torch.Tensor], source: str,
                params: list[tuple[str, nn.Parameter]] | None = None) -> None:
    """Copy each full HF-named tensor of `state` into this rank's shard of the parameter (of `params`, default
    `hf_named_parameters()`); errors name `source`, the folder `state` was read from. A released FP8 checkpoint's
    weights are dequantized by their block scales, one at a time (`tandem.models.fp8.weight_values`): the trainer
    steps the values they stand for."""
    params = policy.hf_named_parameters() if params is None else params
    missing = [name for name, _ in params if name not in state]
    if missing:
        raise KeyError(f"the weights in {source} lack {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    with torch.no_grad():
        for name, param in params:
            full = weight_values(state, name, param.dtype, source)
            if tuple(full.shape) != tuple(param.shape):
                raise ValueError(f"{source}: shape mismatch for {name}: model {tuple(param.shape)}, weights {tuple(full.shape)}")
            full = full.to(device=param.device, dtype=param.dtype)
            if isinstance(param, DTensor):
                # src_data_rank=None: every rank read the full tensor itself, so no scatter is needed.
                shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(full)


def full_parameters(policy: PolicyModel) -> Iterator[tuple[str, torch.Tensor]]:
    """Each published parameter (`PolicyModel.published_parameters`) whole, one at a time (a view of the parameter at
    one rank). Under FSDP each is all-gathered in turn, a collective: every rank must run this to the end, in step with the others."""
    for name, param in policy.published_parameters():
        yield name, plain_values(param.detach().full_tensor() if isinstance(param, DTensor) else param.detach())


def plain_values(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a plain tensor. A tensor subclass that wraps its own values is unwrapped: under FSDP, FP8 training's
    `tensorwise` weights are one (torchao's, so that FSDP gathers them in FP8: `tandem.trainer.float8`), and a
    published folder or a broadcast carries the values, never the wrapper."""
    if not is_traceable_wrapper_subclass(tensor):
        return tensor
    inner = getattr(tensor, tensor.__tensor_flatten__()[0][0])
    if type(inner) is not torch.Tensor or inner.shape != tensor.shape or inner.dtype != tensor.dtype:
        raise TypeError(f"cannot publish a {type(tensor).__name__}: it does not wrap its values as one plain tensor")
    return inner


def to_published(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A copy of `tensor` in `dtype` on `device`, never its storage (the next optimizer step changes the
    parameters while a background write or a send may still read it). Rounded to `dtype` on its own device
    before it moves: torch converts a copy between a GPU and the host on the host, after moving the source's
    type, so fp32 masters published in bf16 would cross the bus at twice the size and then be rounded by the
    CPU (ATen's `copy_kernel_cuda`). One copy only: a rounding that made one is moved without another."""
    rounded = tensor.to(dtype)
    return rounded.to(device, copy=rounded is tensor)


def published_dtypes(policy: PolicyModel, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Each published parameter's dtype: `dtype`, but fp32 for the routers that compute in fp32
    (`moe.fp32_routers`), which the trainer steps and computes in fp32 and the engine holds so: rounded on the way,
    they would route tokens near a tie otherwise than the trainer."""
    fp32 = fp32_router_parameters(policy.lm)
    return {name: torch.float32 if id(param) in fp32 else dtype for name, param in policy.published_parameters()}


def announced_state(policy: PolicyModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Meta tensors of `full_parameters`' names, whole shapes and dtypes (`published_dtypes`): what a broadcast
    announces before the tensors themselves come, one at a time."""
    dtypes = published_dtypes(policy, dtype)
    return {name: torch.empty(param.shape, dtype=dtypes[name], device="meta") for name, param in policy.published_parameters()}


def gather_full_state(policy: PolicyModel, dtype: torch.dtype, keep: bool) -> dict[str, torch.Tensor]:
    """The full HF-named state on the host in `dtype` (`published_dtypes`; `to_published` copies). Every rank must
    call it (see `full_parameters`); only ranks with `keep` hold the result, the others get `{}`."""
    dtypes = published_dtypes(policy, dtype)
    return {name: to_published(full, dtypes[name], "cpu") for name, full in full_parameters(policy) if keep}
