"""How a new policy's weights travel from the trainer to the inference servers (`weight_transport`).

Named apart from the rollout transport (`orchestrator.transport`, batches to the trainer) and from
the `weights` sections (when the trainer publishes, how the orchestrator polls). Trainer and
orchestrator must hold the same value; `tandem rl` sets it once for both (`weight_transport`).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, Tag

from tandem.config.base import Section, default_type_tag


class FilesystemWeightTransport(Section):
    type: Literal["filesystem"] = "filesystem"
    """The trainer writes `weights/step_N/` (safetensors + `STABLE`); each server reloads that folder."""


class BroadcastWeightTransport(Section):
    type: Literal["broadcast"] = "broadcast"
    """Trainer rank 0 sends the tensors over a torch.distributed group (NCCL on CUDA, gloo on CPU)
    to every inference rank; no weight files are written but the last step's."""

    host: str = "127.0.0.1"
    """Address of trainer rank 0, where the group meets (its rendezvous store listens there)."""

    port: int = Field(0, ge=0, le=65535)
    """Port of the group's rendezvous store on `host`; 0: `tandem rl` picks a free one."""

    receiver: Literal["tandem", "vllm"] = "tandem"
    """The servers' backend (`tandem rl` sets it from `inference.backend`): vLLM's servers join through
    vLLM's own NCCL communicator, which trainer rank 0 then uses too (it needs vLLM installed)."""

    num_inference_ranks: int = Field(1, ge=1)
    """Receiving ranks over all servers (servers x ranks per server); `tandem rl` derives it. The
    group's world size is this plus 1 (trainer rank 0); server i takes ranks from 1 + i x ranks per server."""

    bucket_mib: float = Field(256.0, gt=0)
    """Tensors are packed into buckets of about this many MiB, one broadcast each (fewer, larger
    messages; a bucket holds at least one tensor)."""

    quantization: Literal["none", "fp8"] = "none"
    """How the receivers hold each block's dense projections; `tandem rl` sets it from
    `inference.engine.quantization` with tandem's engine (vLLM's servers get `model.dtype` and quantize on their
    own load). `fp8`: trainer rank 0 sends those projections as 128 x 128 block FP8 with their scales, quantized
    by the function the engine quantizes bf16 weights with (`tandem.models.fp8.quantize_weight`), so the engine
    holds exactly what it would have made from the bf16 weights, for about half their bytes on the wire."""

    fp8_experts: bool = True
    """With `quantization` = "fp8": the routed experts are sent in block FP8 too, as the engine holds them with
    `inference.engine.fp8_experts`, from which `tandem rl` sets it."""

    timeout_s: float = Field(300.0, gt=0)
    """Longest wait for the group to form or for one update to cross it; past it the trainer fails
    (a dead server stops the run instead of hanging it). Keep it below `client.timeout_s`."""

    @property
    def world_size(self) -> int:
        return self.num_inference_ranks + 1

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mib * 2**20)


WeightTransportConfig = Annotated[Union[Annotated[FilesystemWeightTransport, Tag("filesystem")],
                                        Annotated[BroadcastWeightTransport, Tag("broadcast")]], default_type_tag("filesystem")]
"""`type = "filesystem"` (default) or `"broadcast"`, each with its own keys."""
