"""tandem's inference config as `vllm serve` arguments (vLLM 0.26), and the checks on them.

Mapped keys: `model.name` (served under that name too), `model.dtype` (`auto` is bfloat16, as on
tandem's CUDA engine), `model.trust_remote_code`, `engine.memory_fraction`, `engine.max_model_len`,
`engine.max_num_seqs`, `engine.kv_cache_dtype` (`--kv-cache-dtype`: vLLM's `auto` is the model's dtype, its `fp8`
float8_e4m3fn), `engine.quantization` (`quantization`), `seed`, `server.host`/`port`/`access_log`, `vllm.tensor_parallel_size`,
`vllm.enable_prefix_caching`; `server.api_key` goes through the environment (`serve_env`). With
`engine.lora`, the base model is served as `server.base_model_name` and the policy as a LoRA adapter named
`model.name` (`--enable-lora`, `--lora-modules` with the adapters' start, runtime loading on), which every
update replaces in place (`/v1/load_lora_adapter`, `tandem/orchestrator/server_dialect.py`). `engine.speculative`
becomes `--speculative-config` (`speculative_config`). The weight-transfer
engine is always on (NCCL), so either weight transport can drive the server; logprobs are always
`processed_logprobs`. Anything else goes through
`vllm.extra_args`. Flag names and forms checked against vLLM 0.26's `EngineArgs.add_cli_args`
(`vllm/engine/arg_utils.py`; booleans are `BooleanOptionalAction`s, so `--no-x` exists) and
`FrontendArgs` (`vllm/entrypoints/openai/cli_args.py`).
"""

from __future__ import annotations

import json
import re

from tandem.config.inference import InferenceConfig

SUPPORTED_VERSION = "0.26"
"""The vLLM minor version whose API (routes, flags, weight transfer) tandem speaks."""

DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
"""vLLM serves `/pause`, `/resume` and the weight-transfer routes only in dev mode."""

_DTYPES = {"auto": "bfloat16", "bfloat16": "bfloat16", "float32": "float32"}

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.26 takes for `--max-lora-rank` (`vllm/config/lora.py`, `MaxLoRARanks`)."""

RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
"""vLLM serves `/v1/load_lora_adapter`, through which a LoRA run's updates arrive, only with this set."""

LOGPROBS_MODE = "processed_logprobs"
"""vLLM's default, `raw_logprobs`, reports log_softmax(logits) before the temperature; tandem's engine and
trainer use log_softmax(logits / T) (`inference/engine/sampler.py`). `processed_logprobs` is that (and the T = 1
logprob for greedy rows, as tandem reports), as long as no top-k/top-p filter renormalizes what is left
(`vllm/v1/sample/sampler.py`, `Sampler.sample`)."""


def speculative_config(config: InferenceConfig) -> dict[str, str | int]:
    """`engine.speculative` in vLLM's `SpeculativeConfig` fields (`vllm/config/speculative.py`): the same drafts,
    verified by vLLM's rejection sampler, which keeps the policy's distribution; a greedy draft model's drafts count
    as one-hot there, so a seed does not give the tokens it gives without speculation, as it does in tandem's engine."""
    spec = config.engine.speculative
    if spec.method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": spec.num_tokens, "prompt_lookup_max": spec.ngram_max,
                "prompt_lookup_min": 1}
    sampling = {"draft_sample_method": "greedy" if spec.draft_sampling == "greedy" else "probabilistic"}
    if spec.method == "mtp":  # vLLM's own MTP layer of the served checkpoint
        return {"method": "mtp", "num_speculative_tokens": spec.num_tokens, **sampling}
    return {"method": "draft_model", "model": spec.draft_model, "num_speculative_tokens": spec.num_tokens, **sampling}


ONLINE_FP8 = "fp8_per_block"
"""vLLM's `--quantization` for tandem's FP8 scheme on a bf16 checkpoint: weights quantized on load in 128 x 128
blocks, activations per token and 128 columns at run time (`vllm/config/quantization.py`, `_ONLINE_SHORTHANDS`;
`model_executor/layers/quantization/online/fp8.py`)."""


def quantization(config: InferenceConfig, checkpoint_fp8: bool) -> str | None:
    """`--quantization` for `engine.quantization`, or None for no flag. A released FP8 checkpoint takes none: vLLM
    reads its `quantization_config` and refuses a flag that names another method; it cannot serve that checkpoint
    unquantized, so `engine.quantization` = "none" with one is an error."""
    if config.engine.quantization == "fp8":
        return None if checkpoint_fp8 else ONLINE_FP8
    if checkpoint_fp8:
        raise ValueError(f"`engine.quantization` = 'none' but {config.model.name} is an FP8 checkpoint, which vLLM "
                         "serves in FP8 only: set `engine.quantization` = 'fp8'")
    return None


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM takes as `--max-lora-rank` that holds adapters of `rank`."""
    fitting = [r for r in LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"`engine.lora.rank` = {rank}: vLLM {SUPPORTED_VERSION} serves adapters of rank at most "
                         f"{LORA_RANKS[-1]}")
    return fitting[0]


def mapped_flags(config: InferenceConfig, adapter_start: str | None = None,
                 checkpoint_fp8: bool = False) -> dict[str, str | bool]:
    """The flags tandem sets from its own keys, by vLLM's dest name (`max_model_len`). A LoRA run needs
    `adapter_start`, the folder of the adapters the policy starts with (`tandem/inference/vllm/server.py`);
    `checkpoint_fp8` says whether the served checkpoint holds FP8 weights (`quantization`)."""
    engine = config.engine
    lora = engine.lora.enabled
    if lora and adapter_start is None:
        raise ValueError("a LoRA run's vLLM server needs the folder of the adapters it starts with")
    flags: dict[str, str | bool] = {
        "served_model_name": config.base_served_name if lora else config.model.name,
        "dtype": _DTYPES[config.model.dtype],
        "gpu_memory_utilization": str(engine.memory_fraction),
        "max_num_seqs": str(engine.max_num_seqs),
        "kv_cache_dtype": engine.kv_cache_dtype,
        "seed": str(config.seed),
        "host": config.server.host,
        "port": str(config.server.port),
        "tensor_parallel_size": str(config.vllm.tensor_parallel_size),
        "enable_prefix_caching": config.vllm.enable_prefix_caching,
        "trust_remote_code": config.model.trust_remote_code,
        "weight_transfer_config": json.dumps({"backend": "nccl"}),
        "logprobs_mode": LOGPROBS_MODE,
        "disable_uvicorn_access_log": not config.server.access_log,
    }
    if engine.max_model_len is not None:
        flags["max_model_len"] = str(engine.max_model_len)
    if (method := quantization(config, checkpoint_fp8)) is not None:
        flags["quantization"] = method
    if engine.speculative.enabled:
        flags["speculative_config"] = json.dumps(speculative_config(config))
    if lora:
        flags |= {"enable_lora": True, "max_lora_rank": str(max_lora_rank(engine.lora.rank)), "max_loras": "1",
                  "lora_modules": json.dumps({"name": config.model.name, "path": adapter_start})}
    return flags


def serve_env(config: InferenceConfig) -> dict[str, str]:
    """The variables `vllm serve` needs besides the caller's: dev mode, runtime LoRA loading in a LoRA run, and the
    API key as `VLLM_API_KEY`, which vLLM reads when `--api-key` is absent: a command line is visible to every user
    of the machine (`ps`)."""
    key = config.server.api_key
    return {**DEV_MODE_ENV, **(RUNTIME_LORA_ENV if config.engine.lora.enabled else {}),
            **({"VLLM_API_KEY": key} if key is not None else {})}


def check_extra_args(config: InferenceConfig, known_flags: set[str]) -> None:
    """Raise ValueError naming an `extra_args` key that vLLM (its `known_flags`, by dest name) does
    not know. (Keys that tandem sets itself are refused by the config already.)"""
    for key in config.vllm.extra_args:
        if key not in known_flags:
            raise ValueError(f"`inference.vllm.extra_args.{key}`: vLLM {SUPPORTED_VERSION} has no flag `--{_dashed(key)}`")


def serve_argv(config: InferenceConfig, adapter_start: str | None = None, checkpoint_fp8: bool = False) -> list[str]:
    """The arguments after `vllm serve` (`adapter_start`, `checkpoint_fp8`: see `mapped_flags`)."""
    argv = [config.model.name]
    for key, value in {**mapped_flags(config, adapter_start, checkpoint_fp8), **config.vllm.extra_args}.items():
        if value is True:
            argv.append(f"--{_dashed(key)}")
        elif value is False:
            argv.append(f"--no-{_dashed(key)}")
        else:
            argv += [f"--{_dashed(key)}", str(value)]
    return argv


def flags_in_help(help_text: str) -> set[str]:
    """The dest names of the flags a `vllm serve --help=all` text lists (`--no-x` counts as `x`)."""
    return {flag.removeprefix("no-").replace("-", "_") for flag in re.findall(r"(?<![\w-])--([a-z0-9][a-z0-9-]*)", help_text)}


def _dashed(key: str) -> str:
    return key.replace("_", "-")
