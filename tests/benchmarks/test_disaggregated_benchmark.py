"""`benchmarks/disaggregated.py` runs end to end on the CPU (tiny preset, a short workload) and writes its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_staggered_arrivals_benchmark_measures_colocated_and_each_transport(tmp_path):
    out = tmp_path / "pd.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "disaggregated.py"), "--num-decoding", "3",
                          "--output-len", "16", "--long-prompt-len", "128", "--arrival-ms", "50",
                          "--kv-transports", "http,shared_memory", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    for setup in ("colocated", "disaggregated_http", "disaggregated_shared_memory"):
        figures = result[setup]
        assert figures["output_tokens"] == 3 * 16  # EOS ignored: every stream has its length
        assert 0 < figures["tbt_p50_ms"] <= figures["tbt_p99_ms"] and figures["num_long_prompts_served"] >= 1
    for transport in ("http", "shared_memory"):
        figures = result[f"disaggregated_{transport}"]
        # Every long prompt served went over (the threshold sits between the short and the long prompts).
        assert figures["stats"]["num_prefills_failed"] == 0
        assert figures["stats"]["num_prefills_handed"] >= figures["num_long_prompts_served"]
        assert figures["hand_off_ms_per_1k_tokens"] > 0
        assert (tmp_path / "pd" / f"decode-{transport}.log").is_file()  # the servers' logs, kept beside the result
