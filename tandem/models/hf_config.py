"""Reading a Hugging Face `config.json` for a native family: a field that changes the function is
either read or refused with an error naming it, never silently ignored.

The file goes through transformers' own config class first, so that defaults (a field equal to
its default is left out of the file), aliases (`num_experts` / `num_local_experts`) and legacy
spellings (4.x `rope_theta`, MiniMax-M2's `rotary_dim`) are resolved exactly as transformers
resolves them. Fields that do not change the forward (`initializer_range`, `use_cache`,
`output_router_logits`, `router_aux_loss_coef`: a training loss the trainer owns) are not checked.
"""

from __future__ import annotations

import math
from typing import Any

from tandem.models.layers import YarnScaling


class UnsupportedConfig(ValueError):
    """A config.json value tandem's native code does not implement; `field` names the key."""

    def __init__(self, field: str, value: Any, supported: str):
        super().__init__(f"`{field}` = {value!r} is not supported by tandem's native model ({supported})")
        self.field = field


def transformers_config(config: dict[str, Any]) -> Any:
    """config.json as its transformers config object (attributes resolve defaults and aliases)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    return AutoConfig.for_model(config["model_type"], **fields)


def expect(config: Any, field: str, supported: tuple, default: Any = None) -> Any:
    """`config.field` (`default` where absent), which must be one of `supported`."""
    value = config.get(field, default) if isinstance(config, dict) else getattr(config, field, default)
    if value not in supported:
        raise UnsupportedConfig(field, value, f"supported: {', '.join(map(repr, supported))}")
    return value


def rope_parameters(config: Any) -> dict[str, Any]:
    """The normalized `rope_parameters` (transformers moves 4.x `rope_scaling` there); plain RoPE and YaRN are implemented."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    expect(rope, "rope_type", ("default", "yarn"), "default")
    return rope


def yarn_scaling(rope: dict[str, Any], max_position_embeddings: int) -> YarnScaling | None:
    """YaRN's parameters as transformers resolves them (`_compute_yarn_parameters`), None for plain RoPE."""
    if rope.get("rope_type", "default") != "yarn":
        return None
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return YarnScaling(factor=float(factor), original_max_position_embeddings=int(original),
                       attention_factor=float(attention_factor), beta_fast=float(rope.get("beta_fast") or 32),
                       beta_slow=float(rope.get("beta_slow") or 1), truncate=bool(rope.get("truncate", True)))


def decoder_fields(config: Any, layer_types: tuple[str, ...] = ("full_attention",)) -> dict[str, Any]:
    """The `DecoderArgs` fields of a transformers config object, after the checks every family shares
    (`layer_types`: the attention kinds the family implements)."""
    check_common(config, layer_types)
    rope = rope_parameters(config)
    heads = config.num_attention_heads
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=config.num_key_value_heads or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=yarn_scaling(rope, config.max_position_embeddings),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_position_embeddings,
        num_nextn_predict_layers=getattr(config, "num_nextn_predict_layers", 0) or 0,
    )


def check_common(config: Any, layer_types: tuple[str, ...] = ("full_attention",)) -> None:
    """Attention of the kinds in `layer_types` in every layer (full causal attention unless the family says
    otherwise: GLM-5's `indexed_attention`), SiLU-gated feed-forwards, no dropout, unquantized weights."""
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        raise UnsupportedConfig("quantization_config", quantization, "unquantized weights only")
    expect(config, "hidden_act", ("silu",), "silu")
    expect(config, "use_sliding_window", (False,), False)
    expect(config, "attention_dropout", (0, 0.0), 0.0)
    found = getattr(config, "layer_types", None) or []
    if any(t not in layer_types for t in found):
        raise UnsupportedConfig("layer_types", found, f"only {' or '.join(map(repr, layer_types))} layers")
