"""Where each inference server of a run listens and which servers it talks to, over all nodes.

The rule (which node runs which pool) is `DeploymentConfig.server_roles`, stated in `ClusterConfig`'s docstring;
this module turns it into addresses. Every node resolves the same config, so every node computes the same list:
a decode server's prefill servers, the orchestrator's decode servers and the Kubernetes objects all read it.

Peers: a decode server hands prompts to the prefill servers of its own node when its node has any (both pools on
every inference node), else to every prefill server of the run. Among the decode servers that share one set of
prefill servers, prefill server j gets its weight updates from decode server j % (their number): each prefill server
from exactly one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tandem.config.deployment import DeploymentConfig

Role = Literal["colocated", "prefill", "decode"]


@dataclass(frozen=True)
class PlacedServer:
    """One inference server: its node, role, position among its node's servers of that role, address and port."""

    node: int
    role: Role
    index: int
    """Among the servers of its role on its node: names its process (`prefill_1`, `inference_2`)."""
    position: int
    """Among all the servers of its node: its port and device slice (`deployment.inference_ports[position]`)."""
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def name(self) -> str:
        """Process (log and config file) name: `inference`, `inference_1`, ... (colocated or decode servers),
        `prefill`, `prefill_1`, ..."""
        pool = "prefill" if self.role == "prefill" else "inference"
        return pool if self.index == 0 else f"{pool}_{self.index}"


def place_servers(deployment: DeploymentConfig, hosts: list[str], ports: list[int]) -> list[PlacedServer]:
    """Every inference server of the run, node by node: node n's at `hosts[n]`, taking `ports` in order."""
    placed = []
    for node, host in enumerate(hosts):
        roles = deployment.server_roles(node)
        for position, role in enumerate(roles):
            placed.append(PlacedServer(node, role, roles[:position].count(role), position, host, ports[position]))
    return placed


def prefill_peers(servers: list[PlacedServer], decode: PlacedServer) -> list[PlacedServer]:
    """The prefill servers `decode` hands prompts to: its node's, or every one when its node has none."""
    prefill = [s for s in servers if s.role == "prefill"]
    return [s for s in prefill if s.node == decode.node] or prefill


def updates_forwarded_by(servers: list[PlacedServer], decode: PlacedServer) -> list[PlacedServer]:
    """The prefill servers `decode` passes each weight update on to (each prefill server gets them from one)."""
    peers = prefill_peers(servers, decode)
    sharing = [s for s in servers if s.role == "decode" and prefill_peers(servers, s) == peers]
    own = sharing.index(decode)
    return [s for j, s in enumerate(peers) if j % len(sharing) == own]
