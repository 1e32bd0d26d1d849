"""The LoRA section, one class for the trainers (`[trainer.lora]`, `[lora]` of SFT) and the engine
(`[inference.engine.lora]`, which `tandem rl` fills from the trainer's)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tandem.config.base import Section


class LoraConfig(Section):
    """Low-rank adapters (`tandem.models.lora`): the base weights stay frozen, only `A` [rank, in] and `B`
    [out, rank] of each targeted projection train, and only they are checkpointed and published."""

    enabled: bool = False
    """The policy is a frozen base plus adapters. A trainer trains only the adapters (the base held in the compute
    dtype, with no fp32 master and no optimizer state) and publishes PEFT adapter folders (`adapter_config.json`,
    `adapter_model.safetensors`); an engine merges each update's adapters into a kept copy of its base.
    `tandem model export --merge` turns an adapter folder into a model folder."""

    rank: int = Field(16, ge=1)
    """Rank r of each adapter."""

    alpha: float = Field(32.0, gt=0)
    """The adapters' product is scaled by alpha / rank."""

    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Projections to adapt, by the last part of their module name (the defaults: every attention and dense
    feed-forward projection of the Qwen3, GLM-4.5 and MiniMax-M2 families, shared experts included; the routed
    experts are `target_experts`). A name that matches no projection is an error listing the model's. The LM head
    is never adapted."""

    target_experts: list[Literal["gate_up_proj", "down_proj"]] = []
    """The routed experts' projections to adapt in a mixture of experts, whose experts are held stacked
    (`gate_up_proj` [E, 2*I, H], `down_proj` [E, H, I]): each expert gets its own adapter, `A` [E, rank, in] and `B`
    [E, out, rank], published as PEFT's `target_parameters`. Empty: the routed experts stay frozen as the base.
    Naming them for a model without routed experts is an error; the vLLM backend does not take them."""

    share_base: bool = False
    """One copy of the frozen base for trainer and engine on one device (`tandem rl`): the trainer allocates it in
    memory the engine maps (CUDA IPC on a GPU, shared memory on the CPU) and the engine loads no weights of its own,
    serving the policy as the base plus each adapter's low-rank product, added beside every projection (the adapters
    updated in place). Saves a whole copy of the model (15 GiB for an 8B model in bf16), at the cost of two rank-r
    matmuls per adapted projection in each engine step. Needs the `tandem` backend, trainer and engine on the same
    device, one trainer rank without FSDP, no preflight, and adapters on dense projections only."""

    @model_validator(mode="after")
    def _check_targets(self) -> "LoraConfig":
        if self.enabled and not self.target_modules and not self.target_experts:
            raise ValueError("`lora.target_modules` and `lora.target_experts` are empty: name at least one projection")
        if self.share_base and not self.enabled:
            raise ValueError("`lora.share_base` = true needs `lora.enabled` = true: only a LoRA run's base stays frozen")
        if self.share_base and self.target_experts:
            raise ValueError("`lora.share_base` = true with `lora.target_experts`: the engine adds the adapters beside "
                             "dense projections only, not inside its routed-expert kernels; empty `lora.target_experts`")
        return self
