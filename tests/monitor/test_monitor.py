"""metrics.jsonl, the live progress line and the run report, on a real run folder."""

from __future__ import annotations

import io
import json
import math
import re

import httpx

from tandem.config.resolve import free_port
from tandem.monitor.metrics import METRICS_FILE, MetricsWriter, read_metrics
from tandem.monitor.progress import ProgressPrinter, StepBar, bar_once_total_known
from tandem.monitor.prometheus import serve_metrics
from tandem.monitor.report import summarize, write_report


def write_run(run_dir, steps=4):
    orch, trainer = MetricsWriter(run_dir, "orchestrator"), MetricsWriter(run_dir, "trainer")
    for step in range(1, steps + 1):
        record = {"reward/mean": 0.1 * step, "off_policy/mean": 1.0, "time/wait_inference_s": 0.5,
                  "throughput/tokens_per_s": 100.0 * step}
        if step in (1, steps):
            record["eval/reward_mean"] = 0.05 * step
        orch.log(step, record)
        on_policy = step == 1
        trainer.log(step, {"loss": -0.01 * step, "tokens_per_s": 1000.0, "time_wait_batch": 0.0,
                           "mismatch_kl": 2e-9 if on_policy else None,
                           "off_policy_kl": None if on_policy else 4e-5 * step})


def test_metrics_lines_survive_nan_and_a_torn_last_line(tmp_path):
    MetricsWriter(tmp_path, "trainer").log(3, {"loss": math.nan, "ok": 1.5})
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"process": "trainer", "step": 4, "lo')  # a writer caught mid-line
    records = list(read_metrics(tmp_path))
    assert len(records) == 1
    assert records[0]["step"] == 3 and records[0]["loss"] is None and records[0]["ok"] == 1.5


def test_progress_prints_each_step_once_when_both_processes_reported(tmp_path):
    out = io.StringIO()
    printer = ProgressPrinter(tmp_path, max_steps=4, stream=out)
    MetricsWriter(tmp_path, "orchestrator").log(1, {"reward/mean": 0.25, "eval/reward_mean": 0.2})
    printer.update()
    assert out.getvalue() == ""  # the trainer has not finished step 1 yet
    MetricsWriter(tmp_path, "trainer").log(1, {"loss": -0.5, "mismatch_kl": 3e-9, "tokens_per_s": 10.0})
    MetricsWriter(tmp_path, "trainer").log(2, {"loss": -0.4, "off_policy_kl": 7e-5, "tokens_per_s": 10.0})
    MetricsWriter(tmp_path, "orchestrator").log(2, {"reward/mean": 0.5})
    printer.update()
    printer.update()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step    1/4") and "reward 0.250" in lines[0] and "eval 0.200" in lines[0]
    assert "mismatch_kl 3.0e-09" in lines[0]
    # a step without on-policy tokens shows the off-policy KL instead, and the last eval stays shown
    assert "off_policy_kl 7.0e-05" in lines[1] and "eval 0.200" in lines[1] and "reward 0.500" in lines[1]


def test_summary_and_report_from_the_run_folder(tmp_path):
    write_run(tmp_path, steps=8)
    sample_dir = tmp_path / "rollouts" / "step_8"
    sample_dir.mkdir(parents=True)
    (sample_dir / "samples.jsonl").write_text(json.dumps({"reward": 0.75, "env": "reverse_text",
                                                          "completion": "<b>olleh</b>"}) + "\n")
    summary = summarize(tmp_path)
    assert summary["steps"] == 8
    assert math.isclose(summary["reward_first"], (0.1 + 0.2) / 2)
    assert math.isclose(summary["reward_last"], (0.7 + 0.8) / 2)
    assert summary["eval_steps"] == [1, 8]
    assert math.isclose(summary["eval_first"], 0.05) and math.isclose(summary["eval_last"], 0.4)
    assert math.isclose(summary["mismatch_kl_mean"], 2e-9)
    assert math.isclose(summary["off_policy_kl_mean"], 4e-5 * sum(range(2, 9)) / 7)

    page = write_report(tmp_path).read_text()
    charts = re.findall(r"<svg .*?</svg>", page)
    assert len(charts) == 4
    train, evals = ([tuple(map(float, point.split(","))) for point in line.split()]
                    for line in re.findall(r'<polyline points="([^"]+)"', charts[0]))
    assert len(train) == 8 and len(evals) == 2 and "train reward" in charts[0] and "eval reward" in charts[0]
    assert [y for _, y in train] == sorted((y for _, y in train), reverse=True)  # a rising reward climbs the page
    assert [x for x, _ in train] == sorted(x for x, _ in train)
    assert "reverse_text" in page and "&lt;b&gt;olleh&lt;/b&gt;" in page  # rollouts shown, escaped


def test_report_of_a_mixture_of_experts_shows_expert_load_and_router_entropy(tmp_path):
    write_run(tmp_path, steps=3)
    trainer = MetricsWriter(tmp_path, "trainer")
    for step, ratio in ((4, 1.9), (5, 1.4)):
        trainer.log(step, {"loss": 0.0, "router/max_over_mean_worst": ratio, "router/entropy": 2.0,
                           "router/tokens_per_expert": [[3, 1], [2, 2]]})
    assert summarize(tmp_path)["expert_load_max_over_mean_last"] == 1.4
    page = write_report(tmp_path).read_text()
    assert len(re.findall(r"<svg .*?</svg>", page)) == 6
    assert "expert_load_max_over_mean_last" in page


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_step_lines_print_above_a_bar_with_rate_and_time_left(tmp_path):
    out = Terminal()
    printer = ProgressPrinter(tmp_path, max_steps=4, stream=out)
    write_run(tmp_path, steps=2)
    printer.update()
    printer.bar._progress.refresh()
    printer.finish()
    printer.close()
    text = out.getvalue()
    assert "step    1/4" in text and "step    2/4" in text and "done: 2 steps" in text
    assert "2/4" in text and "steps/s" in text and "left" in text  # the bar: done/total, rate, time left


def test_off_a_terminal_a_step_bar_prints_a_plain_line_now_and_then():
    out = io.StringIO()
    bar = StepBar("sft", 600, stream=out, plain_every_s=3600)
    for step in range(1, 601):
        bar.update(step)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sft: step 600/600 (") and "steps/s" in lines[0]


def test_a_bar_made_at_the_first_report_is_closed_however_the_work_ends():
    silent = io.StringIO()
    with bar_once_total_known("data", "row", silent):
        pass
    assert silent.getvalue() == ""  # no report: no bar
    out = io.StringIO()
    try:
        with bar_once_total_known("data", "row", out) as progress:
            progress(3, 10)
            raise ValueError("a bad row")
    except ValueError:
        pass
    assert out.getvalue().startswith("data: row 3/10")  # closed: its last plain line


def test_what_a_process_logs_is_on_its_prometheus_metrics(tmp_path):
    port = free_port()
    writer = MetricsWriter(tmp_path, "orchestrator", serve_metrics("orchestrator", "127.0.0.1", port))
    writer.log(1, {"reward/mean": 0.25, "eval/reward_mean": None, "note": "text"})
    writer.log(2, {"reward/mean": 0.5, "throughput/tokens_per_s": 120})
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("tandem_")}
    assert values == {"tandem_orchestrator_reward_mean": 0.5, "tandem_orchestrator_throughput_tokens_per_s": 120.0,
                      "tandem_orchestrator_step": 2.0}
    assert "# TYPE tandem_orchestrator_reward_mean gauge" in text
    assert serve_metrics("trainer", "127.0.0.1", None) is None  # no port: off
