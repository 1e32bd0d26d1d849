"""`tandem rl` with a prefill and a decode server on the CPU: the run ends as a colocated one does, the decode
server's prompts were prefilled by the prefill server, and the prefill server followed every policy."""

from __future__ import annotations

import re

import pytest
from short_runs import rl_command, run

from tandem.models.presets import init_model
from tandem.monitor.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_a_run_with_prefill_and_decode_pools_ends_and_hands_prompts_over(tmp_path):
    model = init_model("tiny", tmp_path / "model", seed=0)
    out = tmp_path / "run"
    result = run(rl_command(model, out, 2, "--deployment.num_prefill_servers", "1", "--deployment.num_decode_servers", "1",
                            "--inference.disaggregation.min_remote_prefill_tokens", "1", "--ckpt.enabled", "false"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out, "trainer")] == [1, 2]
    handed = re.search(r"prompts handed over by prefill servers: (\d+)", (out / "logs" / "inference.log").read_text())
    assert handed and int(handed.group(1)) > 0
    assert (out / "logs" / "prefill.log").is_file()
