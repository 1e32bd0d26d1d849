"""FP8 training of the decoder blocks' dense projections, through torchao's float8 training (`fp8.enabled`).

tandem's training blocks compute from weight tensors, never by calling the projection modules (`tandem.trainer.block`:
each half is one function of tensors, compiled once for every layer), so a projection trains in FP8 by two steps:
- `apply_float8_training` swaps it for torchao's `Float8Linear` (`convert_to_float8_training`, from outside the model
  and before FSDP): the module says the projection is FP8, and with `tensorwise` under FSDP its weight is wrapped so
  that FSDP all-gathers it in FP8;
- the blocks' `linear` (`Float8Training.linear`) computes what `Float8Linear.forward` computes (torchao's
  `matmul_with_hp_or_float8_args`, with the modules' config) for a weight of a qualifying shape, `F.linear` else.
Both decide by one rule (`qualifies`: both dimensions multiples of 16, what FP8 tensor-core matmuls take), and the
blocks' `linear` reaches exactly the projections `apply_float8_training` considers (`PROJECTIONS`), so a projection
computes in FP8 if and only if its module is a `Float8Linear` (`tests/trainer/test_float8.py`).

What stays in the compute dtype: the LM head (the logprobs' precision), the embeddings (a lookup), the norms, MoE
routers, and the experts of a mixture of experts: the routed ones run `torch._grouped_mm`, whose FP8 form torchao
offers only as a prototype (`torchao.prototype.moe_training`), and the shared ones run inside the eager MoE module,
outside the blocks' `linear`.

Model FLOPs stay the same count (`tandem.trainer.flops`): MFU of an FP8 run is against the bf16 dense peak.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_training_tensor import LinearMMConfig
from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp

from tandem.models.decoder import DecoderLayer, Linear
from tandem.models.layers import MLP

MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada and Hopper onwards."""

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
"""A block's attention projections, by name inside the block."""
DENSE_FEED_FORWARD = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
"""A dense block's feed-forward projections (a mixture of experts has none of these names)."""

log = logging.getLogger(__name__)


def check_float8_device(device: torch.device) -> None:
    """Refuse, at the trainer's start, a device without FP8 tensor cores: a CPU runs FP8 matmuls slower than
    fp32 ones, and an older GPU has none."""
    if device.type != "cuda":
        raise ValueError(f"`fp8.enabled` = true needs a CUDA GPU with FP8 tensor cores (compute capability "
                         f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer); this trainer runs on {device.type}: "
                         "set `fp8.enabled` = false")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(f"`fp8.enabled` = true needs a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                         f"or newer (FP8 tensor cores); {torch.cuda.get_device_name(device)} has "
                         f"{capability[0]}.{capability[1]}: set `fp8.enabled` = false")


def qualifies(weight_shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether a projection of this weight shape [out, in] computes in FP8: both dimensions multiples of 16."""
    return all(size % 16 == 0 for size in weight_shape)


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, config: Float8LinearConfig,
                  mm_config: LinearMMConfig) -> torch.Tensor:
    """`F.linear` with `Float8Linear.forward`'s matmuls where the weight's shape qualifies."""
    if not qualifies(weight.shape):
        return F.linear(x, weight, bias)
    out = matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)
    return out if bias is None else out + bias.to(out.dtype)


@dataclass
class Float8Training:
    """What `apply_float8_training` did: the blocks' `linear`, and which projections compute in FP8."""

    linear: Linear
    """The blocks' projections (see the module's docstring)."""
    converted: list[str]
    """Names (`layers.i.self_attn.q_proj`) of the projections now `Float8Linear`."""
    kept: list[str]
    """Names of the projections kept in the compute dtype: a dimension not a multiple of 16."""

    def summary(self, recipe: str) -> str:
        kept = f" ({', '.join(self.kept[:4])}{' ...' if len(self.kept) > 4 else ''})" if self.kept else ""
        return (f"fp8 training ({recipe}): {len(self.converted)} block projections in FP8, {len(self.kept)} kept in the "
                f"compute dtype, a dimension not a multiple of 16{kept}")


def recipe_config(recipe: Literal["tensorwise", "rowwise"], fsdp: bool) -> Float8LinearConfig:
    """torchao's recipe; under FSDP, `tensorwise` all-gathers the weights in FP8 (scaled from the fp32 masters), while
    `rowwise`, whose scales are per row of the gathered weight, all-gathers them in the compute dtype."""
    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise")


def apply_float8_training(blocks: nn.ModuleList, recipe: Literal["tensorwise", "rowwise"], fsdp: bool) -> Float8Training:
    """Swap each qualifying projection of the native decoder `blocks` for a `Float8Linear`, in place (parameter
    names do not change), before FSDP; `fsdp`: the blocks will be sharded. Logs what it converted and kept."""
    config = recipe_config(recipe, fsdp)
    converted: list[str] = []
    kept: list[str] = []

    def chosen(module: nn.Module, name: str, block: DecoderLayer, index: int) -> bool:
        names = PROJECTIONS + (DENSE_FEED_FORWARD if isinstance(block.mlp, MLP) else ())
        if name not in names or type(module) is not nn.Linear:
            return False
        (converted if qualifies(module.weight.shape) else kept).append(f"layers.{index}.{name}")
        return qualifies(module.weight.shape)

    for index, block in enumerate(blocks):
        if not isinstance(block, DecoderLayer):
            raise TypeError(f"FP8 training needs tandem's decoder blocks, got {type(block).__name__}")
        convert_to_float8_training(block, config=config,
                                   module_filter_fn=functools.partial(chosen, block=block, index=index))
    mm_config = Float8Linear(16, 16, bias=False, config=config, device="meta").linear_mm_config
    training = Float8Training(functools.partial(float8_linear, config=config, mm_config=mm_config), converted, kept)
    log.info(training.summary(recipe))
    return training


def keep_scales_precomputed(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Under FSDP with `tensorwise`, gathering a weight in FP8 needs its scale, from the largest magnitude over all
    its shards: torchao's `precompute_float8_dynamic_scale_for_fsdp` finds it for every weight in one all-reduce, where
    each gather would otherwise all-reduce its own. Found now, for the weights as they are (loaded or resumed), and
    after each optimizer step, so that every gather uses one rule (the two compute the scale in other roundings).
    Elsewhere it finds no such weight and does nothing."""
    precompute_float8_dynamic_scale_for_fsdp(model)
    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
