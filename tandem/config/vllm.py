"""Settings of the vLLM backend (`inference.backend = "vllm"`) that tandem's own engine has no use for.

The keys both backends share (model folder, dtype, memory fraction, max model length, max sequences,
seed) stay where they are; `tandem/inference/vllm/args.py` maps them onto vLLM's flags.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from tandem.config.base import Section


TANDEM_SET_FLAGS = frozenset({
    "served_model_name", "dtype", "gpu_memory_utilization", "max_num_seqs", "seed", "host", "port",
    "tensor_parallel_size", "enable_prefix_caching", "trust_remote_code", "weight_transfer_config",
    "max_model_len", "api_key", "logprobs_mode", "disable_uvicorn_access_log", "kv_cache_dtype",
    "enable_lora", "max_lora_rank", "max_loras", "lora_modules", "speculative_config",
    "quantization",
})
"""`vllm serve` flags (by dest name) that tandem sets from its own keys (`tandem/inference/vllm/args.py`; `api_key`
through the environment, as `VLLM_API_KEY`)."""


class VllmConfig(Section):
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs of one vLLM server (`--tensor-parallel-size`); servers are counted apart, by
    `deployment.num_inference_servers`."""

    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (`--enable-prefix-caching`): a group's rollouts
    share their prompt."""

    extra_args: dict[str, str | int | float | bool] = {}
    """Other `vllm serve` flags, by their long name without dashes (`{max_num_batched_tokens = 8192}`);
    `true` passes a bare flag. A name vLLM does not know, or one tandem sets itself, is a config error."""

    @field_validator("extra_args")
    @classmethod
    def _not_set_by_tandem(cls, extra_args: dict) -> dict:
        for key in extra_args:
            if key in TANDEM_SET_FLAGS:
                raise ValueError(f"`inference.vllm.extra_args.{key}`: tandem sets `--{key.replace('_', '-')}` from its "
                                 "own config (docs/vllm.md lists which key); set that key instead")
        return extra_args
