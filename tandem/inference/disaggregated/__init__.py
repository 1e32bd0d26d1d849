"""Prefill/decode disaggregation: prefill servers compute prompts, decode servers generate, the KV cache moves.

Clients (the orchestrator's pool) talk to decode servers only, so the affinity of groups and turns holds there as
for colocated servers. A decode server hands a prompt to a prefill server when enough of it is missing from its own
prefix cache (`decode.RemotePrefill`); it then writes the KV blocks it gets into its cache and samples the first
token itself from the handed logits row (`tandem.inference.engine.prefilled`).

Invariants:
- a request never fails because of a prefill server: a refused, failed or late hand-off, or one computed by other
  weights than the decode server holds when the blocks land, is prefilled on the decode server;
- both halves of a request run one policy version: the decode server asks for its own version, the prefill server
  refuses (409) any other, and the engine re-checks when the blocks land;
- a decode server passes each weight update on to the prefill servers it was given (`forward_updates_to`), so that
  both pools follow the policy without the orchestrator knowing about prefill servers.

Modules: `wire` (what crosses between the servers), `held` (computed prompts waiting for their decode server),
`prefill_api` (the prefill server's routes), `kv_transport` (how the KV blocks cross: `http_body`,
`torch_distributed`, `shared_memory`), `peers` (a decode server's client of its prefill servers), `decode` (where to prefill).
"""

from __future__ import annotations

import torch

from tandem.config.inference import DisaggregationConfig, InferenceConfig
from tandem.inference.disaggregated.decode import RemotePrefill
from tandem.inference.disaggregated.http_body import HTTPBodyTransport
from tandem.inference.disaggregated.kv_transport import KVTransport
from tandem.inference.disaggregated.peers import PrefillPeers
from tandem.inference.disaggregated.shared_memory import SharedMemoryTransport
from tandem.inference.disaggregated.torch_distributed import TorchDistributedTransport
from tandem.inference.engine.async_engine import AsyncEngine


def make_kv_transport(name: str, device: torch.device, peer_timeout_s: float) -> KVTransport:
    """The decode server's half of `disaggregation.kv_transport` = `name`, taking the tensors into `device`."""
    if name == "http":
        return HTTPBodyTransport(device)
    if name == "torch_distributed":
        return TorchDistributedTransport(device, peer_timeout_s)
    if name == "shared_memory":
        return SharedMemoryTransport(device)
    raise ValueError(f"unknown `disaggregation.kv_transport` = {name!r}")


def connect_prefill_servers(config: InferenceConfig, engine: AsyncEngine) -> RemotePrefill:
    """A decode server's prefill servers, each checked and its KV transport joined (`PeerUnreachable` if not)."""
    settings = config.disaggregation
    transport = make_kv_transport(settings.kv_transport, engine.engine.device, settings.peer_timeout_s)
    peers = PrefillPeers(settings, transport, config.server.api_key)
    peers.check(config.model.name, engine.engine.block_manager.block_size, engine.engine.runner.cache.layout)
    return RemotePrefill(engine, peers, settings.min_remote_prefill_tokens, max_received_bytes(settings, engine))


def max_received_bytes(settings: DisaggregationConfig, engine: AsyncEngine) -> int:
    """`disaggregation.max_received_mib`, or the engine's KV cache size where it is None."""
    if settings.max_received_mib is not None:
        return int(settings.max_received_mib * 2**20)
    return engine.engine.kv_bytes(engine.engine.block_manager.num_blocks)
