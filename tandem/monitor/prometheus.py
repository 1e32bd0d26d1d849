"""Prometheus `/metrics` of the orchestrator and the trainer: the latest value of every metric they log.

What a process writes to `metrics.jsonl` (`MetricsWriter.log`) is also what it exposes, one gauge per key,
named `tandem_<process>_<key>` with every character Prometheus does not allow in a name made `_`
(`reward/mean` of the orchestrator is `tandem_orchestrator_reward_mean`), plus `tandem_<process>_step`.
So the two never disagree, and a new metric needs no registration.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily


def metric_name(process: str, key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", f"tandem_{process}_{key}")


class LatestMetrics:
    """A prometheus_client collector of the numbers of the last `record` call, per key."""

    def __init__(self, process: str):
        self.process = process
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        with self._lock:
            self._values.update(numbers, step=float(step))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            values = dict(self._values)
        for key, value in sorted(values.items()):
            yield GaugeMetricFamily(metric_name(self.process, key), f"`{key}` of the {self.process}'s latest step", value=value)


def serve_metrics(process: str, host: str, port: int | None) -> LatestMetrics | None:
    """Serve `/metrics` on `host:port` from a daemon thread and return the collector to feed (None: no port, off)."""
    if port is None:
        return None
    collector = LatestMetrics(process)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    start_http_server(port, addr=host, registry=registry)
    return collector
