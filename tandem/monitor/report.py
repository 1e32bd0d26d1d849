"""`report.html`: what a person looks at after a run. Curves as charts, a few rollouts.

Built only from the run folder (`metrics.jsonl`, `rollouts/step_N/samples.jsonl`), so it can be
rebuilt for any finished or interrupted run: `python -m tandem.monitor.report RUN_DIR`.
"""

from __future__ import annotations

import html
import json
import math
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
    drafted, accepted = (sum(series(orch, key)[1]) for key in ("speculative/draft_tokens", "speculative/accepted_tokens"))
    if drafted:  # speculative decoding
        summary["speculative_acceptance"] = accepted / drafted
    return summary


COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")
"""One per curve of a chart, in the order the curves are given."""

WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 640, 320, 64, 12, 44, 42
"""A chart's size and the margins around its plotting area (title and legend above it), in pixels."""


def _plot(curves: list[tuple[str, list, list]], title: str, xlabel: str = "step") -> str:
    """A line chart as inline SVG, drawn here: a plotting library's import and rendering cost more than a second at
    the end of every run, for four small charts."""
    drawn = [(label, [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]) for label, xs, ys in curves]
    drawn = [(label, points) for label, points in drawn if points]
    xs_all = [x for _, points in drawn for x, _ in points]
    ys_all = [y for _, points in drawn for _, y in points]
    x0, x1 = (min(xs_all), max(xs_all)) if xs_all else (0, 1)
    y0, y1 = (min(ys_all), max(ys_all)) if ys_all else (0, 1)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * (WIDTH - LEFT - RIGHT)

    def py(y: float) -> float:
        return HEIGHT - BOTTOM - (y - y0) / (y1 - y0) * (HEIGHT - TOP - BOTTOM)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-size="11">',
             f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
             f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 6}" text-anchor="middle">{html.escape(xlabel)}</text>']
    for k in range(5):  # grid lines with their values, both axes
        y, x = y0 + (y1 - y0) * k / 4, x0 + (x1 - x0) * k / 4
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#ddd"/>'
                     f'<text x="{LEFT - 4}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.3g}</text>'
                     f'<text x="{px(x):.1f}" y="{HEIGHT - BOTTOM + 14}" text-anchor="middle">{x:.4g}</text>')
    parts.append(f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}" '
                 'fill="none" stroke="#888"/>')
    legend_x = LEFT
    for i, (label, points) in enumerate(drawn):
        color = COLORS[i % len(COLORS)]
        line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        if len(points) < 30:
            parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}"/>' for x, y in points]
        parts.append(f'<line x1="{legend_x}" x2="{legend_x + 18}" y1="{TOP - 12}" y2="{TOP - 12}" stroke="{color}" '
                     f'stroke-width="2"/><text x="{legend_x + 24}" y="{TOP - 8}">{html.escape(label)}</text>')
        legend_x += 40 + 6 * len(label)  # side by side above the plotting area, where no curve runs
    parts.append("</svg>")
    return "".join(parts)


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
    if any("speculative/acceptance" in r for r in orch):  # the servers drafted tokens
        figures.append(_plot([("accepted share of drafted tokens", *series(orch, "speculative/acceptance")),
                              ("accepted drafts per generated token", *series(orch, "speculative/accepted_per_token"))],
                             "Speculative decoding"))
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(_fmt(v))}</td></tr>" for k, v in summary.items())
    samples = "".join(
        f"<details><summary>reward {html.escape(_fmt(s.get('reward')))} — {html.escape(str(s.get('env', '')))}</summary>"
        f"<pre>{html.escape(json.dumps(s, indent=1, ensure_ascii=False)[:4000])}</pre></details>"
        for s in _samples(run_dir)
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>tandem run {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:1400px;margin:2em auto}} svg{{margin:4px}} td{{padding:2px 12px}} pre{{white-space:pre-wrap}}</style>
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
