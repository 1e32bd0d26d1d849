"""`GET /metrics` in Prometheus text format (version 0.0.4), through prometheus_client: the engine's counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tandem.inference.engine.llm_engine import EngineStats

SERIES = [
    ("tandem_num_requests_running", "gauge", "Sequences in the running batch.", "num_running"),
    ("tandem_num_requests_waiting", "gauge", "Sequences waiting for admission (memory or batch full).", "num_waiting"),
    ("tandem_kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use (0 to 1).", "kv_cache_usage"),
    ("tandem_prompt_tokens_total", "counter", "Prompt tokens of all requests received.", "num_prompt_tokens"),
    ("tandem_generation_tokens_total", "counter", "Tokens sampled.", "num_generation_tokens"),
    ("tandem_num_preemptions_total", "counter", "Sequences preempted (to be recomputed) for lack of KV blocks.", "num_preemptions"),
    ("tandem_weight_version", "gauge", "Version of the weights now serving.", "weight_version"),
    ("tandem_spec_decode_draft_tokens_total", "counter", "Tokens drafted and verified (speculative decoding).",
     "num_draft_tokens"),
    ("tandem_spec_decode_accepted_tokens_total", "counter",
     "Drafted tokens the policy accepted (speculative decoding).", "num_accepted_tokens"),
]
"""Name (as exposed), type, help and the `EngineStats` field of each series."""


class _EngineCollector:
    def __init__(self, stats: EngineStats, model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self):
        for name, kind, help_text, attr in SERIES:
            family = (CounterMetricFamily(name.removesuffix("_total"), help_text, labels=["model_name"]) if kind == "counter"
                      else GaugeMetricFamily(name, help_text, labels=["model_name"]))
            family.add_metric([self.model_name], getattr(self.stats, attr))
            yield family


def render_metrics(stats: EngineStats, model_name: str) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(stats, model_name))
    return generate_latest(registry).decode()
