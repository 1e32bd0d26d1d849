"""Config of the RL trainer (`tandem trainer`), and the sections it shares with `tandem sft`.

`TrainingProcessConfig` holds what both trainers need (device, parallelism, optimizer, schedule,
checkpoints, weight publishing); `TrainerConfig` adds the RL loss and the rollout input. Variants
(loss, optimizer, scheduler) are discriminated unions on `type`, so `--loss.type ppo_clip` picks
a section whose other keys are checked against that variant only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, Tag, model_validator

from tandem.config.base import ProcessCheckpointConfig, ProcessConfig, PrometheusConfig, Section, default_type_tag as _default_tag
from tandem.config.lora import LoraConfig
from tandem.config.weight_transport import FilesystemWeightTransport, WeightTransportConfig


class _LossBase(Section):
    router_replay: bool = False
    """Mixture of experts: route each token the trainer recomputes through the experts the inference server
    used when it sampled the next token (the batch's `routed_experts`; needs
    `orchestrator.sampling.return_routed_experts = true`), instead of the trainer's own top-k. The router's
    weights of those experts stay differentiable."""


class AIPOLoss(_LossBase):
    """Truncated importance sampling: per token `-min(r, delta) * A`, r = pi_theta / mu."""

    type: Literal["aipo"] = "aipo"
    """Loss variant."""

    delta: float = Field(8.0, gt=0)
    """Upper bound of the importance ratio; tokens above it give no gradient."""


class DPPOKLLoss(_LossBase):
    """Token masking by probability difference, plus a `kl_tau * (log r)^2` penalty."""

    type: Literal["dppo_kl"] = "dppo_kl"
    """Loss variant."""

    delta: float = Field(0.2, gt=0, lt=1)
    """Mask a token with A > 0 when p_theta - p_mu > delta, and one with A <= 0 when p_theta - p_mu < -delta."""

    kl_tau: float = Field(1e-3, ge=0)
    """Weight of the `(log r)^2` penalty, applied to every loss token."""


class PPOClipLoss(_LossBase):
    """PPO's clipped surrogate: per token `-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)`."""

    type: Literal["ppo_clip"] = "ppo_clip"
    """Loss variant."""

    clip_low: float = Field(0.2, ge=0, lt=1)
    """The ratio is clipped below at `1 - clip_low`."""

    clip_high: float = Field(0.2, ge=0)
    """The ratio is clipped above at `1 + clip_high` (0.28 is DAPO's clip-higher)."""


class CustomLoss(_LossBase):
    """A user function `fn(inputs: tandem.trainer.loss.LossInputs, **kwargs) -> LossOutput`."""

    type: Literal["custom"] = "custom"
    """Loss variant."""

    path: str
    """Import path of the function, `package.module:function`."""

    kwargs: dict[str, Any] = {}
    """Keyword arguments passed to the function on every call."""


LossConfig = Annotated[Union[Annotated[AIPOLoss, Tag("aipo")], Annotated[DPPOKLLoss, Tag("dppo_kl")],
                             Annotated[PPOClipLoss, Tag("ppo_clip")], Annotated[CustomLoss, Tag("custom")]], _default_tag("aipo")]


class _OptimBase(Section):
    lr: float = Field(1e-6, gt=0)
    """Peak learning rate (reached at the end of the scheduler's warmup)."""

    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""

    max_grad_norm: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""


class AdamWConfig(_OptimBase):
    type: Literal["adamw"] = "adamw"
    """Optimizer variant."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's moment decay rates."""

    eps: float = Field(1e-8, gt=0)
    """Adam's denominator epsilon."""


class SGDConfig(_OptimBase):
    type: Literal["sgd"] = "sgd"
    """Optimizer variant."""

    momentum: float = Field(0.0, ge=0, lt=1)
    """SGD momentum (0: plain SGD)."""


OptimConfig = Annotated[Union[Annotated[AdamWConfig, Tag("adamw")], Annotated[SGDConfig, Tag("sgd")]], _default_tag("adamw")]


class ConstantSchedule(Section):
    type: Literal["constant"] = "constant"
    """Schedule variant: linear warmup, then the peak learning rate."""

    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warmup from 0 to the peak learning rate."""


class LinearSchedule(Section):
    type: Literal["linear"] = "linear"
    """Schedule variant: linear warmup, then linear decay until `max_steps`."""

    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warmup from 0 to the peak learning rate."""

    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Learning rate at `max_steps`, as a fraction of the peak."""


class CosineSchedule(Section):
    type: Literal["cosine"] = "cosine"
    """Schedule variant: linear warmup, then cosine decay until `max_steps`."""

    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warmup from 0 to the peak learning rate."""

    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Learning rate at `max_steps`, as a fraction of the peak."""


SchedulerConfig = Annotated[Union[Annotated[ConstantSchedule, Tag("constant")], Annotated[LinearSchedule, Tag("linear")],
                                  Annotated[CosineSchedule, Tag("cosine")]], _default_tag("constant")]


class ActivationCheckpointConfig(Section):
    mode: Literal["off", "selective", "full", "every_k"] = "selective"
    """What transformer blocks recompute in backward. `selective`: everything but attention, which
    keeps its inputs and output (native models; for Qwen3-0.6B 14 KiB per token and block, the
    recompute costs a third more block matmul FLOPs and no attention FLOPs); on models that fall
    back to transformers it acts as `full`. `full`: every block entirely (least memory, attention
    computed twice); `every_k`: blocks 0, k, 2k, ... entirely; `off`: nothing (most memory)."""

    k: int = Field(2, ge=1)
    """With `mode = "every_k"`, checkpoint one block in `k`."""


class ParallelConfig(Section):
    reshard_after_forward: bool = True
    """FSDP: free each block's gathered parameters after its forward (less memory, one more all-gather in backward).
    At one rank its compute copies likewise, except under `kernels.compile_stack`, which holds them for the pass."""

    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter."""

    fsdp_at_one_rank: bool = False
    """Shard with FSDP2 also at world size 1. Off, one rank trains plain tensors (`tandem.trainer.parallel.one_rank`):
    the same numbers bit for bit, without FSDP's per-block host work each step; on, the old path (for comparison)."""

    ep: int = Field(1, ge=1)
    """Expert parallelism: ranks each MoE block's routed experts are split over (all-to-all token
    dispatch). EP borrows data-parallel ranks: it must divide the world size and the model's
    `num_experts`. 1: every rank holds every expert (FSDP-sharded like any weight)."""

    cp: int = Field(1, ge=1)
    """Context parallelism: ranks each packed row's tokens are split over (zigzag shards, ring
    attention; latent attention gathers the row's latents). CP borrows data-parallel ranks: it must divide the
    world size; the `cp` ranks of a group train the rows of all of them together. Native models only. 1: every
    rank holds whole rows."""

    cp_attention: Literal["ring", "ulysses"] = "ring"
    """How a context-parallel shard attends. `ring`: k/v blocks passed around the `cp` ranks, partial
    results merged by log-sum-exp (any head count; plain PyTorch math per block); for latent attention
    (GLM-5, DeepSeek-V3) the row's latent entries gathered instead, the only choice there. `ulysses`: two
    all-to-alls turn token shards into head shards, so each rank attends every token of 1/cp of the
    heads with the single-device kernels (the key/value heads must divide by `cp`)."""

    cp_query_chunk: int = Field(1024, ge=1)
    """Context parallelism: queries per chunk of ring attention (of latent attention over the gathered
    row). A chunk holds chunk x (row / cp) fp32 scores per query head (chunk x row for latent attention), in
    forward and again in backward."""

    activation_checkpoint: ActivationCheckpointConfig = ActivationCheckpointConfig()
    """Recompute activations in backward to save memory."""


SDPABackendName = Literal["cudnn", "flash", "efficient", "math"]


class KernelsConfig(Section):
    """How the native model's blocks and the logprob head run: speed only, the math is the same."""

    compile: Literal["auto", "on", "off"] = "auto"
    """`torch.compile` the pointwise work around attention in each block and the fp32 work of the
    logprob head (one graph for all layers and row lengths). `auto`: on CUDA only (on a CPU the
    compile time outweighs the gain)."""

    compile_stack: bool = True
    """Where it applies (a dense native model on one rank without FSDP, `selective` or no activation
    checkpointing, no context parallelism), compile all the blocks as one graph instead of each block's halves
    apart: far less host time per step (`tandem.trainer.stack`), a longer first compile."""

    sdpa_backends: list[SDPABackendName] = ["cudnn", "flash", "efficient", "math"]
    """Fused SDPA kernels for rows of one document on CUDA, most preferred first (the first that
    supports the inputs runs). Packed rows use variable-length FlashAttention."""

    @model_validator(mode="after")
    def _check_backends(self) -> "KernelsConfig":
        if not self.sdpa_backends:
            raise ValueError("`kernels.sdpa_backends` is empty; name at least one of cudnn, flash, efficient, math")
        return self


class RouterConfig(Section):
    """Load balancing of mixture-of-experts routers (router statistics are always logged for MoE models)."""

    aux_loss_coef: float = Field(0.0, ge=0)
    """Weight of the load-balancing loss, alpha * sum_e f_e * P_e per MoE block (f_e: tokens of expert
    e times E / (k N); P_e: its mean router score), summed over blocks. 0 (default): off, as RL
    usually keeps the routing of the policy that sampled."""

    bias_update_rate: float = Field(0.0, ge=0)
    """Auxiliary-loss-free balancing (DeepSeek-V3) for routers with `e_score_correction_bias` (GLM-4.5,
    MiniMax-M2): after each step, bias += rate * sign(mean load - load) over the step's tokens of all
    ranks (DeepSeek-V3 used 1e-3). 0 (default): the bias stays as loaded."""


class Float8TrainingConfig(Section):
    """FP8 matmuls in the decoder blocks' dense projections (q, k, v, o and a dense feed-forward's gate, up, down),
    through torchao's float8 training (`tandem.trainer.float8`): both operands of each projection's three matmuls
    (forward, input gradient, weight gradient) are scaled to `float8_e4m3fn` on the fly, the fp32 master weights and
    the optimizer stay as they are, and so do the LM head, the embeddings, the norms, the routers and the routed
    experts. A projection whose dimensions are not multiples of 16 stays bf16. Needs a GPU with FP8 tensor cores
    (compute capability 8.9 or newer) and torchao (`pip install tandem-rl[fp8]`); pays where the projections' matmuls
    are a large share of the step (long rows of a wide model), compiled."""

    enabled: bool = False
    """Train the qualifying projections in FP8. Not with `lora.enabled` nor `run.exact`."""

    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """How each operand is scaled. `tensorwise`: one scale per tensor (fastest; under FSDP the weights are also
    all-gathered in FP8, half the bytes of bf16). `rowwise`: one scale per row of each operand (closer to bf16 where
    rows differ much in size, somewhat slower; under FSDP the weights are all-gathered in bf16, then scaled)."""


class MultiTokenPredictionConfig(Section):
    """The multi-token prediction (MTP) layer of GLM-5 and DeepSeek-V3 checkpoints, or a decoder family's draft
    head (`tandem model add-draft-head`): `model.mtp_layers`, which an engine can draft with (`tandem.trainer.mtp`)."""

    train: bool = False
    """Train the MTP layer with the policy: a cross-entropy loss of its prediction of token t+2 on the loss tokens
    of every row (in RL the sampled completions: the layer learns to predict what the policy samples), so a
    speculative draft from it keeps its acceptance as the policy moves; logged as `mtp/loss`. The trunk's hidden
    states, the embeddings and the LM head enter that loss without gradient and the layer's gradients are clipped
    apart: the policy's loss, gradients and updates are those of a run with the layer frozen, bit for bit. Off: the
    layer stays as loaded. Only for a model with one MTP layer; not with `lora.enabled` nor `parallel.ep` > 1."""


class TrainerCheckpointConfig(ProcessCheckpointConfig):
    """DCP checkpoints (model, optimizer, scheduler, data position, RNG) under `checkpoints/step_N/trainer/`;
    the last step is always checkpointed when enabled."""

    keep: int | None = Field(2, ge=1)
    """Complete checkpoints to keep (oldest deleted first); unset keeps all."""


class WeightPublishConfig(Section):
    """When the trainer writes HF-format policy folders for the inference servers."""

    interval: int = Field(1, ge=1)
    """Publish `weights/step_N/` every `interval` steps (and at the last step)."""

    keep: int | None = Field(3, ge=2)
    """Weight folders to keep, newest first (at least 2: the orchestrator may still be loading the previous one); unset keeps all."""

    keep_every: int | None = Field(None, ge=1)
    """Also keep, beyond `keep`, every folder whose step is a multiple of this, so that step k * keep_every + 1
    can be replayed (`tandem replay`: it needs the policy that step trained). Each kept folder costs the
    model's size in its published dtype (Qwen3-0.6B in bf16: 1.2 GB; 100 steps at keep_every 10: 12 GB).
    Unset: only `keep` decides. A multiple of `interval`, since other steps are never published."""

    @model_validator(mode="after")
    def _check_keep_every(self) -> "WeightPublishConfig":
        if self.keep_every is not None and self.keep_every % self.interval:
            raise ValueError(f"`weights.keep_every` = {self.keep_every} is not a multiple of `weights.interval` = "
                             f"{self.interval}: those steps are never published")
        return self


class TrainingProcessConfig(ProcessConfig):
    """Fields shared by the RL trainer and the SFT trainer."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: CUDA when available, else CPU. Under torchrun, `cuda` uses the device LOCAL_RANK."""

    optim: OptimConfig = AdamWConfig()
    """Optimizer."""

    scheduler: SchedulerConfig = ConstantSchedule()
    """Learning-rate schedule over `max_steps`."""

    parallel: ParallelConfig = ParallelConfig()
    """FSDP2 and activation checkpointing."""

    ckpt: TrainerCheckpointConfig = TrainerCheckpointConfig()
    """Checkpoints to resume from."""

    weights: WeightPublishConfig = WeightPublishConfig()
    """Publishing of HF-format policy weights (`weights/step_N/`)."""

    logprob_chunk_size: int = Field(1024, ge=1)
    """Tokens per chunk of the LM-head logprobs: bounds the [tokens x vocab] logits held at once
    (chunk x vocab x 4 bytes compiled: bf16 logits and their gradient; about 5x that in eager mode)."""

    kernels: KernelsConfig = KernelsConfig()
    """Compilation and attention kernels."""

    lora: LoraConfig = LoraConfig()
    """Low-rank adapters instead of full fine-tuning."""

    fp8: Float8TrainingConfig = Float8TrainingConfig()
    """FP8 matmuls in the blocks' dense projections."""

    router: RouterConfig = RouterConfig()
    """Load balancing of MoE routers."""

    mtp: MultiTokenPredictionConfig = MultiTokenPredictionConfig()
    """Training of the model's multi-token prediction layer."""

    prometheus: PrometheusConfig = PrometheusConfig()
    """Prometheus `/metrics` of the trainer (its first rank)."""

    @model_validator(mode="after")
    def _check_fp8_can_hold(self) -> "TrainingProcessConfig":
        if not self.fp8.enabled:
            return self
        if self.run.exact:
            raise ValueError("`fp8.enabled` with `run.exact` = true: FP8 products round differently from the engine's "
                             "bf16 batch-invariant kernels, so the trainer's logprobs cannot equal the engine's bit for "
                             "bit; turn one of them off")
        if self.lora.enabled:
            raise ValueError("`fp8.enabled` with `lora.enabled`: an adapted projection multiplies by W + B @ A, formed "
                             "anew at each forward, while FP8 training scales, and under FSDP gathers in FP8, the "
                             "projection's own weight; turn one of them off")
        return self

    @model_validator(mode="after")
    def _check_mtp_can_train(self) -> "TrainingProcessConfig":
        if self.mtp.train and self.lora.enabled:
            raise ValueError("`mtp.train` with `lora.enabled`: LoRA publishes only the adapters, so the trained MTP "
                             "layers would never reach the engine; turn one of them off")
        if self.mtp.train and self.parallel.cp > 1:
            raise ValueError(f"`mtp.train` with `parallel.cp` = {self.parallel.cp}: the MTP layer reads token t + 1 beside "
                             "the hidden state at t, both of the whole row, and is trained on whole rows only; set "
                             "`parallel.cp` = 1 or `mtp.train` = false")
        return self


class RolloutDataConfig(Section):
    fake: bool = False
    """Train on random batches instead of waiting for the orchestrator's rollouts (benchmarks, smoke tests)."""

    fake_rows: int = Field(2, ge=1)
    """Fake mode: rows (micro-batches) per step over all ranks; a multiple of the world size."""

    fake_samples_per_row: int = Field(1, ge=1)
    """Fake mode: samples packed in each row of `seq_len` tokens (half prompt, half completion)."""

    poll_interval_s: float = Field(0.05, gt=0)
    """How often to look for `rollouts/step_N/rank_R.msgpack` while waiting."""

    wait_timeout_s: float | None = Field(None, gt=0)
    """Give up (exit non-zero) after waiting this long for one step's batch; unset waits forever."""


class TrainerConfig(TrainingProcessConfig):
    """Root config of the RL trainer."""

    loss: LossConfig = AIPOLoss()
    """The off-policy RL loss."""

    data: RolloutDataConfig = RolloutDataConfig()
    """Where batches come from."""

    weight_transport: WeightTransportConfig = FilesystemWeightTransport()
    """How published policies reach the inference servers."""

    @model_validator(mode="after")
    def _check_fake_shape(self) -> "TrainerConfig":
        if self.data.fake and self.seq_len // self.data.fake_samples_per_row < 2:
            raise ValueError(
                f"`data.fake_samples_per_row` = {self.data.fake_samples_per_row} leaves fewer than 2 tokens per sample "
                f"at `seq_len` = {self.seq_len}; lower it"
            )
        return self
