"""What differs between the inference backends on the wire, in one place: the token-in route,
its request and answer shapes, how a server loads a published weights folder, and where a turn's
policy version comes from.

- tandem: `POST /v1/generate {"prompt_token_ids", <flat sampling fields>}`; each choice carries
  `token_ids`, `logprobs` (a list of floats) and `weight_version`, the oldest policy that sampled
  any of its tokens, as the server knows it. A folder loads with `POST /update_weights {"path",
  "version"}`, between two engine steps.
- vLLM 0.26: `POST /inference/v1/generate {"token_ids", "sampling_params"}`
  (`vllm/entrypoints/scale_out/token_in_token_out/`); each choice carries `token_ids` and
  `logprobs.content[j].logprob`, and no version. vLLM has no folder route (its `/update_weights`
  takes only the NCCL engine's `update_info`): a folder loads through the dev route
  `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path"}}`, which runs
  `Worker.reload_weights` (`vllm/v1/worker/gpu_model_runner.py`) on every worker, inside
  `/pause?mode=keep` ... `/resume` (the pause also drops the prefix cache and has the in-flight
  requests recompute their KV, so no cached KV of the old policy is used afterwards).
  The version is then the one the server held when the request was sent: the pool records each
  server's version as its updates finish and holds new requests to a server while it updates, and
  an update pauses in-flight requests (`/pause?mode=keep`) so they finish with the new weights
  after starting with the old ones, of which the older is recorded. A request that reached vLLM
  just before a pause but had sampled nothing yet is recorded one version older than it is
  (conservative: never newer).
  In a LoRA run vLLM serves the base under its own name and the policy as a LoRA adapter named as tandem's
  model (`tandem/inference/vllm/args.py`): each request names the policy (`model`), and a published adapter
  folder (PEFT's, with `adapter_config.json`) replaces that adapter in place (`POST /v1/load_lora_adapter
  {"lora_name", "lora_path", "load_inplace": true}`, inside the same pause, whose cache reset also drops the
  prefixes cached under the old adapter).

The pool speaks the dialect; everything above it sees tandem's shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
"""The file that makes a published weights folder a PEFT adapter folder (`tandem.models.lora`)."""


class TandemDialect:
    generate_path = "/v1/generate"
    pauses_for_folder_update = False
    """tandem's server swaps a folder's weights between two steps and versions each token itself."""

    def to_request(self, payload: dict[str, Any]) -> dict[str, Any]:
        return payload

    def from_response(self, body: dict[str, Any], version_at_send: int) -> dict[str, Any]:
        return body

    def folder_update(self, path: str, version: int) -> tuple[str, dict[str, Any]]:
        """The call that loads the weights folder `path` as policy `version`."""
        return "/update_weights", {"path": path, "version": version}


class VllmDialect:
    generate_path = "/inference/v1/generate"
    pauses_for_folder_update = True

    def __init__(self, policy_name: str | None = None):
        self.policy_name = policy_name
        """The served name requests ask for (the LoRA adapter's in a LoRA run); None: vLLM's first served name."""

    def to_request(self, payload: dict[str, Any]) -> dict[str, Any]:
        if payload.get("return_routed_experts"):
            raise ValueError("`return_routed_experts` (router replay) is served by tandem's engine only: vLLM 0.26 "
                             "returns experts only when started with --enable-return-routed-experts, in another format")
        params = {k: v for k, v in payload.items() if k not in ("prompt_token_ids", "return_routed_experts")}
        # logprobs = 0: the sampled token's logprob only, which is what training needs.
        request = {"token_ids": payload["prompt_token_ids"], "sampling_params": {**params, "logprobs": 0}}
        return request | ({"model": self.policy_name} if self.policy_name is not None else {})

    def from_response(self, body: dict[str, Any], version_at_send: int) -> dict[str, Any]:
        choices = [{"index": c.get("index", i), "token_ids": c["token_ids"], "finish_reason": c.get("finish_reason"),
                    "logprobs": [entry["logprob"] for entry in c["logprobs"]["content"]],
                    "weight_version": version_at_send} for i, c in enumerate(body["choices"])]
        return {"id": body.get("request_id"), "choices": choices}

    def folder_update(self, path: str, version: int) -> tuple[str, dict[str, Any]]:
        if (Path(path) / ADAPTER_CONFIG).is_file():
            if self.policy_name is None:
                raise ValueError(f"{path} is a LoRA adapter folder: loading it into vLLM needs the policy's served name")
            return "/v1/load_lora_adapter", {"lora_name": self.policy_name, "lora_path": path, "load_inplace": True}
        # `/collective_rpc` passes kwargs as given (strings only, by its own rule); the version stays client-side.
        return "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}


def dialect_of(backend: str, policy_name: str | None = None) -> TandemDialect | VllmDialect:
    """The dialect of `backend`; `policy_name` (`model.name`) is the name vLLM serves the policy under."""
    if backend == "tandem":
        return TandemDialect()
    if backend == "vllm":
        return VllmDialect(policy_name)
    raise ValueError(f"unknown inference backend {backend!r}; known: tandem, vllm")
