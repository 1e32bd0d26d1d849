"""`tandem rl` with speculative decoding, GLM-5's way: the policy's own MTP layer drafts (GLM-5's, or a Qwen3 draft
head from `tandem model init --draft-head`), the trainer trains that layer with the policy, and each update carries it
to the server. The run records its drafts' acceptance per step
beside the usual records, and the rollouts' logprobs stay the policy's: the mismatch KL stays under the bound the
learning test holds runs without drafts to (tests/launch/test_rl_e2e.py)."""

from __future__ import annotations

import pytest
from short_runs import rl_command, run

from tandem.models.presets import init_model
from tandem.monitor.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-with-head"])
def test_an_rl_run_drafts_with_the_mtp_layer_it_trains_and_logs_acceptance(preset, tmp_path):
    model = (init_model("tiny", tmp_path / "model", seed=0, draft_head=True) if preset == "tiny-with-head"
             else init_model(preset, tmp_path / "model", seed=0))
    out = tmp_path / "run"
    result = run(rl_command(model, out, 3, "--inference.engine.speculative.method", "mtp",
                            "--inference.engine.speculative.num-tokens", "2", "--trainer.mtp.train", "true",
                            "--ckpt.enabled", "false"))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in read_metrics(out, "orchestrator") if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["speculative/draft_tokens"] > 0 and 0 <= r["speculative/accepted_tokens"] <= r["speculative/draft_tokens"], r
        assert r["speculative/acceptance"] == pytest.approx(r["speculative/accepted_tokens"] / r["speculative/draft_tokens"])
    trainer = list(read_metrics(out, "trainer"))
    assert [r["step"] for r in trainer] == [1, 2, 3] and all(r["mtp/loss"] > 0 for r in trainer)
    kls = [r["mismatch_kl"] for r in trainer if r["mismatch_kl"] is not None]
    assert kls and max(kls) < 1e-3, kls
    report = (out / "report.html").read_text()
    assert "Speculative decoding" in report and "<td>speculative_acceptance</td>" in report
