"""Build a causal LM from a model folder: tandem's own code where it has it, else transformers.

Every model returned here has the same interface: `forward(input_ids, position_ids,
attention=None) -> hidden [B, T, H]`, an `lm_head` linear, `layers` (the blocks parallelism wraps)
and `hf_config` (the config.json dict).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tandem.models.hub import resolve_model_path
from tandem.models.qwen3 import Qwen3Args, Qwen3ForCausalLM
from tandem.models.weights import load_state_dict

NATIVE = {"qwen3": (Qwen3Args, Qwen3ForCausalLM)}
"""model_type -> (args class, model class) implemented natively."""


def resolve_dtype(dtype: str, device: str | torch.device) -> torch.dtype:
    """`auto` is bf16 on CUDA and fp32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def read_hf_config(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def is_native(hf_config: dict) -> bool:
    return hf_config.get("model_type") in NATIVE


def build_native(hf_config: dict, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32) -> nn.Module:
    """An uninitialized native model (on `meta` by default: no memory until `to_empty`)."""
    args_cls, model_cls = NATIVE[hf_config["model_type"]]
    with torch.device(device):
        model = model_cls(args_cls.from_hf(hf_config))
    model.hf_config = hf_config
    return model.to(dtype)


def load_weights_into(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy HF-named tensors into `model`; shapes must match; tied lm_head may be absent.

    A floating parameter takes any floating dtype (cast on copy: fp32 weights into a bf16 model);
    integers never pass for weights, and a non-floating tensor of the model needs its own dtype.
    """
    params = dict(model.state_dict())
    missing = [k for k in params if k not in state and not (k == "lm_head.weight" and "model.embed_tokens.weight" in state and _tied(model))]
    unexpected = [k for k in state if k not in params]
    if strict and (missing or unexpected):
        raise KeyError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if name not in params:
            continue
        if params[name].shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name}: model {tuple(params[name].shape)}, weights {tuple(tensor.shape)}")
        if not _dtype_fits(params[name].dtype, tensor.dtype):
            raise ValueError(f"dtype mismatch for {name}: model {_dtype_name(params[name].dtype)}, weights {_dtype_name(tensor.dtype)}")
    with torch.no_grad():
        for name, tensor in state.items():
            if name in params:
                params[name].copy_(tensor)


def _dtype_fits(model_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    return dtype.is_floating_point if model_dtype.is_floating_point else dtype == model_dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tied(model: nn.Module) -> bool:
    """Tied embeddings, from a native model's `args` or a transformers model's `config`."""
    settings = getattr(model, "args", None) or getattr(model, "config", None)
    return bool(getattr(settings, "tie_word_embeddings", False))


def load_causal_lm(name: str, device: str | torch.device = "cpu", dtype: str = "auto", trust_remote_code: bool = False) -> nn.Module:
    """Load weights of `name` (folder or hub name) onto `device`: meta init, then weights."""
    folder = resolve_model_path(name)
    hf_config = read_hf_config(folder)
    torch_dtype = resolve_dtype(dtype, device)
    if is_native(hf_config):
        model = build_native(hf_config, "meta", torch_dtype)
        model.to_empty(device=device)
        if _tied(model):  # to_empty breaks parameter sharing; tie again
            model.lm_head.weight = model.model.embed_tokens.weight
        load_weights_into(model, load_state_dict(folder, device))
        return model.eval()
    from tandem.models.hf_fallback import HFCausalLM

    return HFCausalLM.from_pretrained(folder, device, torch_dtype, trust_remote_code)
