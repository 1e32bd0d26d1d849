"""`GET /metrics` in Prometheus text format (version 0.0.4), written by hand: a handful of series."""

from __future__ import annotations

from tandem.inference.engine.llm_engine import EngineStats

SERIES = [
    ("tandem_num_requests_running", "gauge", "Sequences in the running batch.", "num_running"),
    ("tandem_num_requests_waiting", "gauge", "Sequences waiting for admission (memory or batch full).", "num_waiting"),
    ("tandem_kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use (0 to 1).", "kv_cache_usage"),
    ("tandem_prompt_tokens_total", "counter", "Prompt tokens of all requests received.", "num_prompt_tokens"),
    ("tandem_generation_tokens_total", "counter", "Tokens sampled.", "num_generation_tokens"),
    ("tandem_num_preemptions_total", "counter", "Sequences preempted (to be recomputed) for lack of KV blocks.", "num_preemptions"),
    ("tandem_weight_version", "gauge", "Version of the weights now serving.", "weight_version"),
]


def render_metrics(stats: EngineStats, model_name: str) -> str:
    label = model_name.replace("\\", "\\\\").replace('"', '\\"')
    lines = []
    for name, kind, help_text, attr in SERIES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f'{name}{{model_name="{label}"}} {getattr(stats, attr)}']
    return "\n".join(lines) + "\n"
