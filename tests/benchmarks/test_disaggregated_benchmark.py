"""`benchmarks/disaggregated.py` runs end to end on the CPU (tiny preset, a short workload) and writes its figures,
the breakdown of each setup's steps among them."""

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
                          "--output-len", "64", "--long-prompt-len", "128", "--arrival-ms", "50",
                          "--kv-transports", "http,shared_memory", "--isolate", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    for setup in ("colocated", "disaggregated_http", "disaggregated_shared_memory", "decode_prefill_busy", "decode_alone"):
        figures = result[setup]
        assert figures["output_tokens"] == 3 * 64  # EOS ignored: every stream has its length
        assert 0 < figures["tbt_p50_ms"] <= figures["tbt_p99_ms"]
        assert figures["num_long_prompts_served"] >= (setup != "decode_alone")
        steps = figures["steps"]  # the decoding phase: most of the 63 steps after the streams' first tokens (16 left a few ms)
        assert steps["num_steps"] >= 5 and steps["slow"]["num_steps"] >= 1 and steps["median"]["num_steps"] >= 1
    # Handed-over prompts joined the decode servers' batches, never the colocated one's.
    assert result["colocated"]["steps"]["by_cause"]["joined"]["num_steps"] == 0
    assert result["disaggregated_http"]["steps"]["by_cause"]["joined"]["num_steps"] >= 1
    assert result["decode_alone"]["steps"]["by_cause"]["joined"]["num_steps"] == 0
    assert result["decode_prefill_busy"]["steps"]["by_cause"]["joined"]["num_steps"] == 0
    for transport in ("http", "shared_memory"):
        figures = result[f"disaggregated_{transport}"]
        # Every long prompt served went over (the threshold sits between the short and the long prompts).
        assert figures["stats"]["num_prefills_failed"] == 0
        assert figures["stats"]["num_prefills_handed"] >= figures["num_long_prompts_served"]
        assert figures["hand_off_ms_per_1k_tokens"] > 0
        assert (tmp_path / "pd" / f"decode-{transport}.log").is_file()  # the servers' logs, kept beside the result
        assert json.loads((tmp_path / "pd" / f"decode-{transport}.steps.json").read_text())["steps"]  # and the records
