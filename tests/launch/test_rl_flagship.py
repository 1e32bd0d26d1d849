"""`tandem rl` with GLM-5 served as `examples/reverse_text_glm5/flagship.toml` serves it, on the CPU: FP8 weights and
an FP8 latent cache in the engine, drafts from the MTP layer the trainer trains with the policy, a prefill and a
decode server. Each part has tests of its own; this one runs them together, through the example's own overlay: the
run ends, the decode server's prompts were prefilled by the prefill server, drafts were made and verified, the MTP
layer trained, and the rollouts' logprobs carry FP8's rounding within the bound the preflight holds such a server to."""

from __future__ import annotations

import re

import pytest
from short_runs import REPO, rl_command, run

from tandem.config.rl import PreflightConfig
from tandem.models.presets import init_model
from tandem.monitor.metrics import read_metrics

pytestmark = pytest.mark.slow

FLAGSHIP = REPO / "examples" / "reverse_text_glm5" / "flagship.toml"


def test_glm5_served_in_fp8_with_mtp_drafts_by_a_prefill_and_a_decode_server(tmp_path):
    model = init_model("tiny-glm5", tmp_path / "model", seed=0)
    out = tmp_path / "run"
    result = run(rl_command(model, out, 2, "@", str(FLAGSHIP), "--ckpt.enabled", "false",
                            "--orchestrator.sampling.max-tokens", "16",
                            "--inference.disaggregation.min-remote-prefill-tokens", "1"))
    assert result.returncode == 0, result.stderr[-3000:]
    handed = re.search(r"prompts handed over by prefill servers: (\d+)", (out / "logs" / "inference.log").read_text())
    assert handed and int(handed.group(1)) > 0
    steps = [r for r in read_metrics(out, "orchestrator") if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["speculative/draft_tokens"] > 0 for r in steps), steps
    trainer = list(read_metrics(out, "trainer"))
    assert [r["step"] for r in trainer] == [1, 2] and all(r["mtp/loss"] > 0 for r in trainer)
    kls = [r["mismatch_kl"] for r in trainer if r["mismatch_kl"] is not None]
    # fp32 engine and trainer agree to about 1e-13 (tests/launch/test_rl_speculative.py's runs); FP8 shows
    assert kls and all(1e-7 < kl < PreflightConfig().max_mismatch_kl_fp8 for kl in kls), kls
