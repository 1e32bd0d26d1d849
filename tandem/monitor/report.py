"""`report.html`: what a person looks at after a run. Curves as pictures, a few rollouts.

Built only from the run folder (`metrics.jsonl`, `rollouts/step_N/samples.jsonl`), so it can be
rebuilt for any finished or interrupted run: `python -m tandem.monitor.report RUN_DIR`.
"""

from __future__ import annotations

import base64
import html
import io
import json
import sys
from pathlib import Path
from typing import Any

from tandem.monitor.metrics import read_metrics
from tandem.transport.files import atomic_write_text


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pairs = sorted((r["step"], r[key]) for r in records if r.get(key) is not None)
    return [p[0] for p in pairs], [p[1] for p in pairs]


def summarize(run_dir: Path) -> dict[str, Any]:
    """Headline numbers of a run: first/last rewards, eval before/after, mismatch KL, duration."""
    orch = list(read_metrics(run_dir, "orchestrator"))
    trainer = list(read_metrics(run_dir, "trainer"))
    _, rewards = series(orch, "reward/mean")
    eval_steps, evals = series(orch, "eval/reward_mean")
    _, kl = series(trainer, "mismatch_kl")
    _, off_kl = series(trainer, "off_policy_kl")
    _, imbalance = series(trainer, "router/max_over_mean_worst")
    times = [r["time"] for r in orch + trainer]
    k = max(1, len(rewards) // 4)
    summary = {
        "steps": len(rewards),
        "reward_first": sum(rewards[:k]) / k if rewards else None,
        "reward_last": sum(rewards[-k:]) / k if rewards else None,
        "eval_first": evals[0] if evals else None,
        "eval_last": evals[-1] if evals else None,
        "eval_steps": eval_steps,
        "mismatch_kl_mean": sum(kl) / len(kl) if kl else None,
        "off_policy_kl_mean": sum(off_kl) / len(off_kl) if off_kl else None,
        "duration_s": max(times) - min(times) if times else None,
    }
    if imbalance:  # mixtures of experts only
        summary["expert_load_max_over_mean_last"] = imbalance[-1]
    return summary


def _plot(curves: list[tuple[str, list, list]], title: str, xlabel: str = "step") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=100)
    for label, xs, ys in curves:
        if xs:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    if any(xs for _, xs, _ in curves):
        ax.legend()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _samples(run_dir: Path, limit: int = 4) -> list[dict[str, Any]]:
    steps = sorted((run_dir / "rollouts").glob("step_*/samples.jsonl"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not steps:
        return []
    rows = [json.loads(line) for line in steps[-1].read_text().splitlines() if line.strip()]
    return rows[:limit]


def write_report(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    orch = list(read_metrics(run_dir, "orchestrator"))
    trainer = list(read_metrics(run_dir, "trainer"))
    summary = summarize(run_dir)
    t0 = min((r["time"] for r in orch + trainer), default=0.0)
    throughput = [
        ("trainer tokens/s", [r["time"] - t0 for r in trainer if r.get("tokens_per_s") is not None],
         [r["tokens_per_s"] for r in trainer if r.get("tokens_per_s") is not None]),
        ("inference tokens/s", [r["time"] - t0 for r in orch if r.get("throughput/tokens_per_s") is not None],
         [r["throughput/tokens_per_s"] for r in orch if r.get("throughput/tokens_per_s") is not None]),
    ]
    figures = [
        _plot([("train reward", *series(orch, "reward/mean")), ("eval reward", *series(orch, "eval/reward_mean"))], "Reward"),
        _plot(throughput, "Throughput", xlabel="seconds since start"),
        _plot([("mismatch KL (on-policy tokens)", *series(trainer, "mismatch_kl")), ("off-policy KL", *series(trainer, "off_policy_kl"))], "KL to the sampling policy (k3)"),
        _plot([("loss", *series(trainer, "loss"))], "Loss"),
    ]
    if any("router/entropy" in r for r in trainer):  # a mixture of experts
        figures += [
            _plot([("max / mean tokens per expert (worst MoE layer)", *series(trainer, "router/max_over_mean_worst"))],
                  "Expert load"),
            _plot([("router entropy (mean over MoE layers)", *series(trainer, "router/entropy"))], "Router entropy"),
        ]
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(_fmt(v))}</td></tr>" for k, v in summary.items())
    samples = "".join(
        f"<details><summary>reward {html.escape(_fmt(s.get('reward')))} — {html.escape(str(s.get('env', '')))}</summary>"
        f"<pre>{html.escape(json.dumps(s, indent=1, ensure_ascii=False)[:4000])}</pre></details>"
        for s in _samples(run_dir)
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>tandem run {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:1400px;margin:2em auto}} img{{margin:4px}} td{{padding:2px 12px}} pre{{white-space:pre-wrap}}</style>
</head><body><h1>tandem run: {html.escape(str(run_dir))}</h1>
<h2>Summary</h2><table>{rows}</table><h2>Curves</h2>{''.join(figures)}<h2>Sampled rollouts (last step)</h2>{samples or '<p>none</p>'}
</body></html>"""
    path = run_dir / "report.html"
    atomic_write_text(path, page)
    return path


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


if __name__ == "__main__":
    print(write_report(Path(sys.argv[1])))
