"""Build a causal LM from a model folder: tandem's own code where it has it, else transformers.

Every model returned here has the same interface: `forward(input_ids, position_ids,
attention=None) -> hidden [B, T, H]`, an `lm_head` linear, `layers` (the blocks parallelism wraps)
and `hf_config` (the config.json dict).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tandem.models.fp8 import convert_to_fp8, init_fp8_weights, match_quantization
from tandem.models.fp8_checkpoint import checkpoint_quantization
from tandem.models.glm4_moe import Glm4MoeArgs, Glm4MoeForCausalLM
from tandem.models.glm_moe_dsa import DeepseekV3Args, GlmMoeDsaArgs, LatentMoeForCausalLM
from tandem.models.hf_config import UnsupportedConfig
from tandem.models.hf_fallback import HFCausalLM
from tandem.models.hub import read_hf_config, resolve_model_path
from tandem.models.minimax_m2 import MiniMaxM2Args, MiniMaxM2ForCausalLM
from tandem.models.moe import keep_routers_fp32
from tandem.models.qwen3 import Qwen3Args, Qwen3ForCausalLM
from tandem.models.qwen3_moe import Qwen3MoeArgs, Qwen3MoeForCausalLM
from tandem.models.weights import load_state_dict

NATIVE = {
    "qwen3": (Qwen3Args, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeArgs, Qwen3MoeForCausalLM),
    "glm4_moe": (Glm4MoeArgs, Glm4MoeForCausalLM),
    "minimax_m2": (MiniMaxM2Args, MiniMaxM2ForCausalLM),
    "glm_moe_dsa": (GlmMoeDsaArgs, LatentMoeForCausalLM),
    "deepseek_v3": (DeepseekV3Args, LatentMoeForCausalLM),
}
"""model_type -> (args class, model class) implemented natively."""


def resolve_dtype(dtype: str, device: str | torch.device) -> torch.dtype:
    """`auto` is bf16 on CUDA and fp32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def is_native(hf_config: dict) -> bool:
    return hf_config.get("model_type") in NATIVE


def has_split_blocks(hf_config: dict) -> bool:
    """Whether the model is native and made of `decoder.DecoderLayer`s, split at attention: what the engine's KV
    cache of keys and values and the trainer's compiled block halves work on. The latent-attention
    families (`glm_moe_dsa`, `deepseek_v3`) run whole blocks (`tandem.models.glm_moe_dsa`)
    and the engine keeps their latents (`tandem.inference.engine.kv_cache.LatentCache`)."""
    return is_native(hf_config) and NATIVE[hf_config["model_type"]][1].split_blocks


def build_native(hf_config: dict, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32,
                 source: str = "config.json", keep_mtp: bool = True) -> nn.Module:
    """An uninitialized native model (on `meta` by default: no memory until `to_empty`); `source`
    names the config file in errors. A released FP8 checkpoint's config builds the same layers as its unquantized
    one (the FP8 ones are `tandem.models.fp8.convert_to_fp8`'s choice); any other `quantization_config` is an
    error naming `source` and the field. Without `keep_mtp` the model has none of the config's multi-token
    prediction layers (as if `num_nextn_predict_layers` were 0; `multi_token.without_left_out_layers` drops their
    weights from an update)."""
    args_cls, model_cls = NATIVE[hf_config["model_type"]]
    checkpoint_quantization(hf_config, source)
    try:
        args = args_cls.from_hf({k: v for k, v in hf_config.items() if k != "quantization_config"}
                                | ({} if keep_mtp else {"num_nextn_predict_layers": 0}))
    except UnsupportedConfig as err:
        raise ValueError(f"{source}: {err}") from None
    with _InitSkippedOnMeta(), torch.device(device):
        model = model_cls(args)
    model.hf_config = hf_config
    model.to(dtype)
    keep_routers_fp32(model)
    return model


_INITS = frozenset({getattr(nn.init, name) for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")}
                   | {torch.Tensor.uniform_, torch.Tensor.normal_})
"""The random initializers module constructors call (`nn.init`'s, and the tensor methods they end in)."""


class _InitSkippedOnMeta(TorchFunctionMode):
    """Module constructors' initialization of meta tensors skipped: it computes nothing there, yet torch runs it
    through reference implementations whose first call imports its compiler (dynamo), a cost at the start of every
    process that builds a model and never compiles, such as a server on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITS:
            tensor = args[0] if args else kwargs["tensor"]
            if tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def empty_native(hf_config: dict, device: str | torch.device, dtype: torch.dtype, source: str = "config.json",
                 quantization: str = "none", fp8_experts: bool = False, keep_mtp: bool = True) -> nn.Module:
    """A native model with uninitialized memory on `device` (built on `meta`: no init work), tied again;
    `quantization` "fp8": its dense projections held in FP8 blocks (`tandem.models.fp8`), and with `fp8_experts` its
    routed experts; `keep_mtp`: as `build_native`."""
    model = build_native(hf_config, "meta", dtype, source, keep_mtp)
    if quantization == "fp8":
        convert_to_fp8(model, fp8_experts)
    allocate_empty(model, device)
    retie(model)
    return model


def allocate_empty(model: nn.Module, device: str | torch.device) -> None:
    """`model.to_empty(device)` for a model of plain tensors: torch's `empty_like` of a meta tensor runs through
    its reference implementation, whose first call imports sympy, a cost at the start of every process that loads
    a model and never compiles, such as a server on the CPU; `torch.empty` of the same shape and dtype does not.
    Not for sharded (DTensor) parameters, whose `empty_like` makes the local shard."""
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def load_weights_into(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True, source: str | None = None) -> None:
    """Copy HF-named tensors into `model`; shapes must match; tied lm_head may be absent. Errors
    name `source` (the folder the state came from) where given; nothing is copied unless all fits.

    A floating parameter takes any floating dtype (cast on copy: fp32 weights into a bf16 model);
    integers never pass for weights, and a non-floating tensor of the model needs its own dtype.
    Weights are first brought to the precision the model holds them in (`tandem.models.fp8.match_quantization`).
    """
    params = dict(model.state_dict())
    state = match_quantization(params, state, source)
    missing = [k for k in params if k not in state and not (k == "lm_head.weight" and "model.embed_tokens.weight" in state and _tied(model))]
    unexpected = [k for k in state if k not in params]
    if strict and (missing or unexpected):
        raise KeyError(f"{source or 'the weights'} do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if name not in params:
            continue
        if params[name].shape != tensor.shape:
            raise ValueError(f"{source + ': ' if source else ''}shape mismatch for {name}: model {tuple(params[name].shape)}, weights {tuple(tensor.shape)}")
        if not _dtype_fits(params[name].dtype, tensor.dtype):
            raise ValueError(f"{source + ': ' if source else ''}dtype mismatch for {name}: model "
                             f"{_dtype_name(params[name].dtype)}, weights {_dtype_name(tensor.dtype)}")
    with torch.no_grad():
        for name, tensor in state.items():
            if name in params:
                params[name].copy_(tensor)


def replace_parameters(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Make each parameter of `model` named in `tensors` a frozen parameter over that very tensor (no copy), in every
    module that holds it (tied ones stay tied): how a model on `meta` takes tensors that live elsewhere."""
    named = dict(model.named_parameters())
    replacing = {id(named[name]): nn.Parameter(tensor, requires_grad=False) for name, tensor in tensors.items()}
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None and id(param) in replacing:
                module._parameters[key] = replacing[id(param)]


DUMMY_SEED = 0
"""Seed of `load_format = "dummy"` weights: one value, so trainer and engine make the same model."""


def check_load_format(load_format: str, hf_config: dict) -> None:
    if load_format == "dummy" and not is_native(hf_config):
        raise ValueError(f"`model.load_format` = 'dummy' needs a native model; {hf_config.get('model_type')!r} loads "
                         "through transformers, from its weights")


def retie(model: nn.Module) -> None:
    """Tie the LM head to the embeddings again where the model is tied (`to_empty` unties them)."""
    if _tied(model):
        model.lm_head.weight = model.model.embed_tokens.weight


def _dtype_fits(model_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    return dtype.is_floating_point if model_dtype.is_floating_point else dtype == model_dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tied(model: nn.Module) -> bool:
    """Tied embeddings, from a native model's `args` or a transformers model's `config`."""
    settings = getattr(model, "args", None) or getattr(model, "config", None)
    return bool(getattr(settings, "tie_word_embeddings", False))


def load_causal_lm(name: str, device: str | torch.device = "cpu", dtype: str = "auto", trust_remote_code: bool = False,
                   load_format: str = "safetensors", quantization: str = "none", fp8_experts: bool = False,
                   keep_mtp: bool = True) -> nn.Module:
    """Load weights of `name` (folder or hub name) onto `device`: meta init, then weights (read,
    or random ones made on the device with `load_format` "dummy"). `quantization` "fp8" (native models):
    the dense projections (and with `fp8_experts` the routed experts) held in FP8 blocks, read as such from an FP8
    checkpoint, else quantized on load; without it, an FP8 checkpoint's weights are dequantized to `dtype`.
    Without `keep_mtp` a native model neither holds nor reads the checkpoint's multi-token prediction layers (an
    engine that does not draft with them: as large as a block each, a mixture of experts in GLM-5)."""
    folder = resolve_model_path(name)
    hf_config = read_hf_config(folder)
    torch_dtype = resolve_dtype(dtype, device)
    check_load_format(load_format, hf_config)
    if quantization != "none" and not is_native(hf_config):
        raise ValueError(f"{quantization} layers need a model native to tandem; {folder / 'config.json'} says "
                         f"model_type {hf_config.get('model_type')!r}, which loads through transformers")
    if is_native(hf_config):
        model = empty_native(hf_config, device, torch_dtype, str(folder / "config.json"), quantization, fp8_experts,
                             keep_mtp)
        if load_format == "dummy":
            model.init_weights(DUMMY_SEED)
            init_fp8_weights(model, DUMMY_SEED, torch_dtype)
        else:
            load_weights_into(model, load_state_dict(folder, device, keep_mtp), source=f"the weights in {folder}")
        return model.eval()
    return HFCausalLM.from_pretrained(folder, device, torch_dtype, trust_remote_code)
