"""Render configs for people: resolved TOML for `--dry-run`, key listings for `--help`."""

from __future__ import annotations

from typing import Any

import tomli_w
from pydantic import BaseModel

from tandem.config.base import ProcessConfig
from tandem.config.loader import _models_in
from tandem.config.resolve import server_configs
from tandem.config.rl import RLConfig
from tandem.config.secret import redacted_dump


def to_toml(config: BaseModel) -> str:
    """The config as TOML, secrets redacted (`tandem.config.secret`); `None` values are left out (TOML has no null)."""
    return tomli_w.dumps(_drop_none(redacted_dump(config)))


def dump_process_configs(config: ProcessConfig) -> str:
    """Each process's resolved config under a `# ---- <process> ----` heading and a comment saying
    where it runs (just the config when it is not an RL config). Every inference server of the run is shown, on
    several nodes under its name on that node (`inference.node2`, as its log file), since servers of one name
    differ between nodes (a decode server's prefill servers)."""
    if not isinstance(config, RLConfig):
        return to_toml(config)
    cluster = config.deployment.cluster
    servers = [(f"{s.name}.node{s.node}" if cluster.num_nodes > 1 else s.name, _devices(config, s.position), [s.node], c)
               for s, c in server_configs(config)]
    others = [(p, config.deployment.trainer_devices if p == "trainer" else None,
               [n for n in range(cluster.num_nodes) if p in cluster.roles(n)], getattr(config, p))
              for p in ("orchestrator", "trainer")]
    return "\n".join(f"# ---- {name} ----\n# runs on: {_placement(config, name, devices, nodes)}\n{to_toml(process_config)}"
                     for name, devices, nodes, process_config in servers + others)


def _devices(config: RLConfig, position: int) -> list[int] | None:
    slices = config.deployment.inference_device_slices
    return slices[position] if position < len(slices) else None


def _placement(config: RLConfig, process: str, devices: list[int] | None, nodes: list[int]) -> str:
    deployment = config.deployment
    where = f"CUDA device(s) {devices}" if deployment.type == "gpu" and devices else "the CPU"
    ranks = f"{deployment.num_trainer_ranks} rank(s) on " if process == "trainer" else ""
    cluster = deployment.cluster
    if cluster.num_nodes == 1:
        return ranks + where
    return ranks + where + f" of node(s) {', '.join(f'{n} ({cluster.hosts[n]})' for n in nodes)}"


def describe(model: type[BaseModel], prefix: str = "") -> str:
    """One line per key: dotted name, default and description."""
    lines = []
    for name, field in model.model_fields.items():
        subs = _models_in(field.annotation)
        key = f"{prefix}{name}"
        if subs and len(subs) == 1:
            lines.append(describe(subs[0], key + "."))
            continue
        default = "" if field.is_required() else f" = {field.get_default(call_default_factory=True)!r}"
        lines.append(f"  --{key}{default}\n      {field.description or ''}")
    return "\n".join(lines)


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value
