"""The LoRA section, one class for the trainers (`[trainer.lora]`, `[lora]` of SFT) and the engine
(`[inference.engine.lora]`, which `tandem rl` fills from the trainer's)."""

from __future__ import annotations

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
    feed-forward projection of the Qwen3, GLM-4.5 and MiniMax-M2 families; the routed experts of a mixture of
    experts, held as stacked tensors, are not adapted). A name that matches no projection is an error listing the
    model's. The LM head is never adapted."""

    @model_validator(mode="after")
    def _check_targets(self) -> "LoraConfig":
        if self.enabled and not self.target_modules:
            raise ValueError("`lora.target_modules` is empty: name at least one projection")
        return self
