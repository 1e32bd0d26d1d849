"""Which FP8 checkpoints tandem reads: the one `quantization_config` it knows, checked without torch, so that
`tandem inference --backend vllm`, which leaves the weights to vLLM, can read a checkpoint's scheme too."""

from __future__ import annotations


CHECKPOINT_SCHEME = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""The one `quantization_config` tandem reads; `fmt` and `activation_scheme` may be left out (these are their defaults)."""


def checkpoint_quantization(hf_config: dict, source: str) -> str | None:
    """"fp8" for a checkpoint of `CHECKPOINT_SCHEME`, None for an unquantized one; any other scheme is an
    error naming `source` (its config.json) and the field."""
    config = hf_config.get("quantization_config")
    if not config:
        return None
    defaults = {"fmt": "e4m3", "activation_scheme": "dynamic"}
    for field, expected in CHECKPOINT_SCHEME.items():
        value = config.get(field, defaults.get(field))
        if value != expected:
            raise ValueError(f"{source}: `quantization_config.{field}` = {value!r}; tandem reads block-scaled FP8 "
                             f"checkpoints only ({CHECKPOINT_SCHEME}), or unquantized ones")
    return "fp8"
