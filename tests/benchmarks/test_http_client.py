"""`benchmarks/http_client.py` runs end to end on the CPU (tiny preset, a few short requests) and writes its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_http_benchmark_measures_every_route_against_the_engine(tmp_path):
    out = tmp_path / "http.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "http_client.py"), "--preset", "tiny", "--device", "cpu",
                          "--scale", "0.03", "--repeats", "1", "--client-processes", "2", "--commit", "test",
                          "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    w = result["workload"]
    assert (w["num_prompts"], w["prompt_len"], w["output_len"]) == (7, 3, 15)
    assert result["environment"]["commit"] == "test" and result["client_processes"] == 2
    assert result["engine_A"]["output_tokens"] == 7 * 15
    for route in ("generate", "completions", "chat"):
        figures = result["tandem_server"][route]
        assert "error" not in figures, figures
        assert figures["output_tokens"] == 7 * 15  # EOS ignored: every completion has its length, with its logprobs
        assert 0 < figures["latency_s"]["p50"] <= figures["latency_s"]["p99"] <= figures["latency_s"]["max"]
        assert figures["server_cpu_ms_per_request"] > 0
        ratio = result["ratios"][f"tandem_{route}_over_engine"]
        assert ratio == figures["output_tokens_per_s"] / result["engine_A"]["output_tokens_per_s"]
    assert "vllm_server" not in result  # no --vllm-site, no vLLM part
    assert (tmp_path / "http" / "inference.log").is_file()  # the server's log, kept beside the result
