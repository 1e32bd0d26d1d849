"""LoRA: low-rank adapters on a model's linear projections, applied from outside the model code.

An adapted projection multiplies by `W + (B @ A) * alpha / r`: the base `W` [out, in] frozen, `A` [r, in] and
`B` [out, r] trained (Hu et al. 2021; `B` starts at zero, so step 0 is the base model). The families read
their projections' weights into functional halves (`tandem.models.decoder`) through
`tandem.models.layers.projection_weight`, which gives a `LoraLinear`'s adapted weight, formed by
`adapted_weight`: the trainer's forward, the engine's merge
(`tandem.inference.engine.lora_merge`) and `tandem model export --merge` all call that one function, so on the
same device and dtype they hold the same bits, and the engine samples from the policy the trainer trains.

Names follow PEFT: `<projection>.lora_A.weight` and `<projection>.lora_B.weight` beside the base's
`<projection>.weight`, which keeps its Hugging Face name. An adapter folder is PEFT's (`adapter_config.json`,
`adapter_model.safetensors`, tensors under `base_model.model.`), loadable by `peft`.

The routed experts of a mixture of experts (`tandem.models.moe.GroupedExperts`, stacked [E, out, in]) take one
adapter per expert (`LoraExperts`): `A` [E, r, in] and `B` [E, out, r], held beside the stacked base as
`<experts>.<projection>_lora_A` and `_lora_B`, experts first, so that expert parallelism shards them with the
experts they adapt. `adapted_weight` batches over the experts. In a folder they take PEFT's layout for LoRA on 3-D
parameters (`target_parameters`, `peft.tuners.lora.ParamWrapper`), converted by `to_peft` and `from_peft`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
import torch.nn.functional as F
from torch import nn

from tandem.models.moe import GroupedExperts

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""PEFT's prefix of every tensor name in an adapter file (its wrapper around the causal LM)."""
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
EXPERT_ADAPTER_SUFFIXES = ("_lora_A", "_lora_B")
"""An expert adapter's parameter names: `<experts>.<projection>` and one of these."""
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")
"""The routed experts' stacked projections, in the order `GroupedExperts` and transformers' experts register them:
PEFT nests one wrapper a parameter in that order, which names the tensors of a folder (`peft_expert_module`)."""


@dataclass(frozen=True)
class LoraSpec:
    """What an adapter is: its rank, scale and the projections it adapts (by module name's last part)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    """Sorted, so that two specs of the same targets are equal."""
    target_experts: tuple[str, ...] = ()
    """The routed experts' projections adapted (of `EXPERT_PROJECTIONS`), in that order."""

    def __post_init__(self):
        object.__setattr__(self, "target_modules", tuple(sorted(self.target_modules)))
        object.__setattr__(self, "target_experts", tuple(p for p in EXPERT_PROJECTIONS if p in self.target_experts))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def adapted_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """`base + (B @ A) * scale` in `base`'s dtype: the weight an adapted projection multiplies by (see the module
    docstring for why every side computes it here); stacked experts [E, out, in] take `A` [E, r, in] and `B`
    [E, out, r], one product an expert."""
    return base + (lora_b.to(base.dtype) @ lora_a.to(base.dtype)) * scale


class LoraLinear(nn.Linear):
    """An `nn.Linear` with an adapter. Its parameters are the base's `weight` (and `bias`), frozen, under their own
    names, and the adapter's `lora_A.weight` and `lora_B.weight`. Model code reads a projection's weight through
    `tandem.models.layers.projection_weight`, which gives `adapted_weight()` here; `weight` itself stays the base
    parameter, which FSDP and the one-rank path shard, gather and swap as for any `nn.Linear`."""

    def __init__(self, base: nn.Linear, rank: int, scale: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.scale = scale
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=torch.float32)

    def adapted_weight(self) -> torch.Tensor:
        return adapted_weight(self.weight, self.lora_A.weight, self.lora_B.weight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.adapted_weight(), self.bias)


class LoraExperts(GroupedExperts):
    """Stacked routed experts with one adapter per expert on each targeted projection: the base's `gate_up_proj`
    and `down_proj`, frozen, under their own names, and `<projection>_lora_A` [E, r, in] and `<projection>_lora_B`
    [E, out, r], direct parameters of this module, experts first (expert parallelism shards every parameter of the
    experts along its first dimension). The forward multiplies by `expert_weights()`, the adapted stacks."""

    def __init__(self, base: GroupedExperts, rank: int, scale: float, targets: tuple[str, ...]):
        nn.Module.__init__(self)
        self.num_experts = base.num_experts
        self.gate_up_proj, self.down_proj = base.gate_up_proj, base.down_proj
        self.scale, self.targets = scale, targets
        for projection in targets:
            experts, out_features, in_features = getattr(base, projection).shape
            device = getattr(base, projection).device
            self.register_parameter(f"{projection}_lora_A", nn.Parameter(
                torch.empty(experts, rank, in_features, device=device, dtype=torch.float32)))
            self.register_parameter(f"{projection}_lora_B", nn.Parameter(
                torch.empty(experts, out_features, rank, device=device, dtype=torch.float32)))

    def adapted(self, projection: str) -> torch.Tensor:
        base = getattr(self, projection)
        if projection not in self.targets:
            return base
        return adapted_weight(base, getattr(self, f"{projection}_lora_A"), getattr(self, f"{projection}_lora_B"), self.scale)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.adapted("gate_up_proj"), self.adapted("down_proj")


def projection_names(model: nn.Module) -> list[str]:
    """Every distinct last name part of the model's `nn.Linear` modules: what `target_modules` may name."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)})


def targeted_linears(model: nn.Module, targets: tuple[str, ...], skip: tuple[str, ...] = ("lm_head",)) -> dict[str, nn.Linear]:
    """The model's `nn.Linear`s (name -> module) whose last name part is one of `targets` and none of `skip`: what
    an adapter of those targets adapts, in the trainer and in the engine alike."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets and name.rsplit(".", 1)[-1] not in skip}


def check_targets(model: nn.Module, targets: tuple[str, ...], found: dict[str, nn.Linear], source: str) -> None:
    """An error naming `source` and the model's projections when a target matches none of them."""
    missing = sorted(set(targets) - {name.rsplit(".", 1)[-1] for name in found})
    if missing:
        raise ValueError(f"{source} names {missing}, which match no linear projection of the model; its projections "
                         f"are {[n for n in projection_names(model) if n != 'lm_head']}")


def targeted_experts(model: nn.Module, targets: tuple[str, ...], source: str) -> dict[str, GroupedExperts]:
    """The model's stacked routed experts (name -> module) when `targets` names any of their projections; `targets`
    naming a model without routed experts is an error naming `source`."""
    if not targets:
        return {}
    found = {name: module for name, module in model.named_modules() if isinstance(module, GroupedExperts)}
    if not found:
        raise ValueError(f"{source} names {list(targets)}, but the model has no routed experts (a mixture of experts "
                         f"of {list(EXPERT_PROJECTIONS)}); leave it empty")
    return found


def adapted_parameters(model: nn.Module, spec: LoraSpec, source: str, section: str = "lora") -> dict[str, nn.Parameter]:
    """The base weights `spec` adapts, by the name their adapters pair to (`adapter_pairs`): each targeted
    projection's `<module>.weight`, each targeted expert stack's `<experts>.<projection>`. A target that matches
    nothing is an error naming `source` (the config that named the targets), the key (in `section`) and what the
    model has."""
    found = targeted_linears(model, spec.target_modules)
    check_targets(model, spec.target_modules, found, f"{source}: `{section}.target_modules`")
    params = {f"{name}.weight": module.weight for name, module in found.items()}
    for name, experts in targeted_experts(model, spec.target_experts, f"{source}: `{section}.target_experts`").items():
        params |= {f"{name}.{projection}": getattr(experts, projection) for projection in spec.target_experts}
    return params


def apply_lora(model: nn.Module, spec: LoraSpec, source: str) -> list[str]:
    """Replace every `nn.Linear` that `spec` targets (`targeted_linears`) by a `LoraLinear`, and the routed experts
    by `LoraExperts` when it targets theirs, in place, and freeze every other parameter; returns the adapted
    modules' names. `source` (the config file that named the targets) is named by the error when a target names
    no module."""
    adapted_parameters(model, spec, source)  # the targets' errors, before anything changes
    linears = targeted_linears(model, spec.target_modules)
    experts = targeted_experts(model, spec.target_experts, f"{source}: `lora.target_experts`")
    model.requires_grad_(False)
    for name, module in [*linears.items(), *experts.items()]:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        adapted = (LoraLinear(module, spec.rank, spec.scale) if name in linears else
                   LoraExperts(module, spec.rank, spec.scale, spec.target_experts))
        setattr(parent, child, adapted)
    return sorted([*linears, *experts])


def lora_modules(model: nn.Module) -> list[tuple[str, LoraLinear]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLinear)]


def lora_experts(model: nn.Module) -> list[tuple[str, LoraExperts]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraExperts)]


def initial_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every adapter's start, whole, under its parameter name, drawn from `seed` in module order (the same on every
    rank and in every run): PEFT's, A uniform in +-1/sqrt(in) (Kaiming with a = sqrt(5)) and B zero, so the adapted
    weight starts as the base."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in lora_modules(model):
        bound = 1 / math.sqrt(module.in_features)
        shape = (module.lora_A.out_features, module.in_features)
        state[f"{name}.lora_A.weight"] = torch.rand(shape, generator=generator).mul_(2 * bound).sub_(bound)
        state[f"{name}.lora_B.weight"] = torch.zeros(module.out_features, shape[0])
    for name, module in lora_experts(model):
        for projection in module.targets:
            lora_a, lora_b = (getattr(module, f"{projection}{suffix}") for suffix in EXPERT_ADAPTER_SUFFIXES)
            bound = 1 / math.sqrt(lora_a.shape[-1])
            state[f"{name}.{projection}_lora_A"] = torch.rand(lora_a.shape, generator=generator).mul_(2 * bound).sub_(bound)
            state[f"{name}.{projection}_lora_B"] = torch.zeros(lora_b.shape)
    return state


def write_start_folder(folder: Path, model_folder: Path, spec: LoraSpec, seed: int) -> None:
    """The adapter folder of a policy that starts as the base (B zero, `initial_adapters`) for the model in
    `model_folder`, shaped from its config alone (the model is built on `meta`): what a server that loads adapters
    from folders serves before the first update."""
    from tandem.models.hub import read_hf_config
    from tandem.models.loading import build_native

    hf_config = read_hf_config(model_folder)
    model = build_native(hf_config, source=str(Path(model_folder) / "config.json"))
    apply_lora(model, spec, str(model_folder))
    write_adapter_folder(folder, initial_adapters(model, seed), spec, str(model_folder))


def is_adapter_name(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES) or name.endswith(EXPERT_ADAPTER_SUFFIXES)


def adapter_config_json(spec: LoraSpec, base_model: str) -> dict:
    """PEFT's `adapter_config.json` for `spec` (the fields `peft.LoraConfig` reads, at their meaning here); expert
    adapters are `target_parameters`, named as transformers' mixtures of experts hold them."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": spec.rank,
              "lora_alpha": spec.alpha, "target_modules": sorted(spec.target_modules), "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
              "modules_to_save": None, "inference_mode": True}
    if spec.target_experts:
        config["target_parameters"] = [f"mlp.experts.{projection}" for projection in spec.target_experts]
    return config


def peft_expert_module(experts: str, projection: str, targets: tuple[str, ...]) -> str:
    """The module name PEFT gives the adapter of `projection` of the stacked experts `experts`: PEFT wraps the
    targeted parameters one around the other in registration order, the last outermost, so each targeted
    projection registered after this one adds a `.base_layer`."""
    return experts + ".base_layer" * (len(targets) - 1 - targets.index(projection))


def to_peft(state: dict[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """Adapters under tandem's names -> PEFT's: expert adapters `A` [E, r, in] -> [E * r, in] (expert-major rows) and
    `B` [E, out, r] -> [out, r * E] (rank-major columns), as `ParamWrapper` holds them; others unchanged."""
    out = {}
    for name, tensor in state.items():
        if not name.endswith(EXPERT_ADAPTER_SUFFIXES):
            out[name] = tensor
            continue
        experts, _, parameter = name.rpartition(".")
        projection, which = parameter[:-len("_lora_A")], parameter[-1]
        module = peft_expert_module(experts, projection, spec.target_experts)
        flat = tensor.reshape(-1, tensor.shape[-1]) if which == "A" else tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1)
        out[f"{module}.lora_{which}.weight"] = flat
    return out


def from_peft(state: dict[str, torch.Tensor], spec: LoraSpec, source: str) -> dict[str, torch.Tensor]:
    """The inverse of `to_peft`: a folder's adapters (PEFT names without the prefix) under tandem's names."""
    out = {}
    for name, tensor in state.items():
        module, _, which = name.removesuffix(".weight").rpartition(".lora_")
        depth = module.count(".base_layer")
        experts = module.replace(".base_layer", "")
        if not (spec.target_experts and experts.endswith(".experts")):
            out[name] = tensor
            continue
        if depth >= len(spec.target_experts):
            raise ValueError(f"{source}: {name!r} nests deeper than the {len(spec.target_experts)} `target_parameters`")
        projection = spec.target_experts[len(spec.target_experts) - 1 - depth]
        if which == "A":
            stacked = tensor.reshape(-1, spec.rank, tensor.shape[-1])
        else:
            stacked = tensor.reshape(tensor.shape[0], spec.rank, -1).permute(2, 0, 1)
        out[f"{experts}.{projection}_lora_{which}"] = stacked.contiguous()
    return out


def write_adapter_folder(folder: Path, state: dict[str, torch.Tensor], spec: LoraSpec, base_model: str) -> None:
    """`adapter_model.safetensors` (under PEFT's names and layout, `to_peft`) and `adapter_config.json`, each
    written tmp + rename."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + name: t.detach().contiguous().cpu() for name, t in to_peft(state, spec).items()}
    tmp = folder / f".{ADAPTER_WEIGHTS}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / ADAPTER_WEIGHTS)
    tmp = folder / f".{ADAPTER_CONFIG}.tmp"
    tmp.write_text(json.dumps(adapter_config_json(spec, base_model), indent=2) + "\n")
    os.replace(tmp, folder / ADAPTER_CONFIG)


def is_adapter_folder(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def read_adapter_folder(folder: Path) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """The spec and the adapter tensors (under the model's own names) of a PEFT LoRA folder; a scheme this
    module does not compute (DoRA, rsLoRA, biases, saved modules) is an error naming the file and field."""
    folder = Path(folder)
    config_file = folder / ADAPTER_CONFIG
    config = json.loads(config_file.read_text())
    refused = {"peft_type": ("LORA",), "use_dora": (False, None), "use_rslora": (False, None), "bias": ("none", None),
               "modules_to_save": (None, []), "fan_in_fan_out": (False, None)}
    for field, allowed in refused.items():
        if config.get(field, allowed[-1]) not in allowed:
            raise ValueError(f"{config_file}: `{field}` = {config.get(field)!r} is not supported (LoRA adapters as "
                             f"`W + B @ A * alpha / r` only)")
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        raise ValueError(f"{config_file}: `target_modules` = {targets!r}: a list of module names is needed")
    parameters = config.get("target_parameters") or []
    experts = [str(p).rpartition(".")[-1] for p in parameters] if isinstance(parameters, list) else []
    if not isinstance(parameters, list) or any(not str(p).endswith(f"experts.{e}") or e not in EXPERT_PROJECTIONS
                                               for p, e in zip(parameters, experts)):
        raise ValueError(f"{config_file}: `target_parameters` = {parameters!r}: only the routed experts' stacked "
                         f"projections are adapted as parameters ({[f'mlp.experts.{e}' for e in EXPERT_PROJECTIONS]})")
    spec = LoraSpec(int(config["r"]), float(config["lora_alpha"]), tuple(targets), tuple(experts))
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    state = {}
    for name, tensor in tensors.items():
        own = name.removeprefix(PEFT_PREFIX).replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        if not own.endswith(ADAPTER_SUFFIXES):
            raise ValueError(f"{folder / ADAPTER_WEIGHTS}: {name!r} is no LoRA A or B matrix")
        state[own] = tensor
    return spec, from_peft(state, spec, str(folder / ADAPTER_WEIGHTS))


def adapter_pairs(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Adapter tensors grouped by the base weight they adapt: `<module>.weight` -> (A, B), and for stacked experts
    `<experts>.<projection>` -> (A, B); a module with only one of its two matrices is an error."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        for which, suffix, base_suffix in (("A", ".lora_A.weight", ".weight"), ("B", ".lora_B.weight", ".weight"),
                                           ("A", "_lora_A", ""), ("B", "_lora_B", "")):
            if name.endswith(suffix):
                pairs.setdefault(name.removesuffix(suffix) + base_suffix, {})[which] = tensor
    lonely = [name for name, pair in pairs.items() if len(pair) != 2]
    if lonely:
        raise KeyError(f"adapters without both LoRA matrices: {lonely[:5]}")
    return {name: (pair["A"], pair["B"]) for name, pair in pairs.items()}


def merged_state(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """`base` (HF-named) with every adapted weight replaced by `adapted_weight`; the adapters must fit the base."""
    merged = dict(base)
    for name, (lora_a, lora_b) in adapter_pairs(adapters).items():
        if name not in base:
            raise KeyError(f"an adapter for {name}, which the base model does not have")
        merged[name] = adapted_weight(base[name], lora_a, lora_b, spec.scale)
    return merged


def base_fingerprint(folder: Path, weight_files: list[Path]) -> str:
    """SHA-256 of a base model's config.json and weight files: what a LoRA checkpoint was trained on, checked
    when it resumes (adapters mean nothing on another base)."""
    digest = hashlib.sha256()
    for path in [Path(folder) / "config.json", *weight_files]:
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def export_merged(adapter_folder: Path, out: Path, base: str | None = None) -> Path:
    """Write a Hugging Face model folder at `out`: the base model (`base`, default the adapter folder's
    `base_model_name_or_path`) with the adapters merged in, in the base's dtype, and the base's config and tokenizer."""
    from tandem.models.hub import read_hf_config, resolve_model_path
    from tandem.models.weights import load_state_dict, save_state_dict, side_files, unquantized_side_file

    spec, adapters = read_adapter_folder(adapter_folder)
    name = base or json.loads((Path(adapter_folder) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not name:
        raise ValueError(f"{Path(adapter_folder) / ADAPTER_CONFIG} names no `base_model_name_or_path`: pass the base model")
    folder = resolve_model_path(name)
    merged = merged_state(load_state_dict(folder), adapters, spec)
    out = Path(out)
    save_state_dict(merged, out, read_hf_config(folder))
    for src in side_files(folder):
        (out / src.name).write_bytes(unquantized_side_file(src))
    return out
