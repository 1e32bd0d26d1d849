"""The RL trainer end to end in one process: fake mode, rollout files, publishing, NaN guard,
checkpoints and exact resume, bad input."""

from __future__ import annotations

import hashlib
import math
import sys
import types

import pytest
import torch

from tandem.cli import main as cli_main
from tandem.models.loading import load_causal_lm
from tandem.models.weights import load_state_dict
from tandem.trainer.checkpoint import complete_checkpoints
from tandem.transport.paths import STABLE, checkpoint_dir, weights_dir

from trainer_helpers import losses, metrics, random_row, run_trainer, write_rollouts


def digest(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_fake_mode_command_publishes_step_3(tiny_model, tmp_path):
    out = tmp_path / "out"
    code = cli_main(["trainer", "--device", "cpu", "--model.name", str(tiny_model), "--data.fake", "--max-steps", "3", "--output-dir", str(out),
                     "--seq-len", "64", "--optim.lr", "1e-3"])
    assert code == 0
    step3 = weights_dir(out, 3)
    assert (step3 / STABLE).is_file()
    assert {p.name for p in step3.iterdir()} >= {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                                                 "tokenizer_config.json", STABLE}
    assert "lm_head.weight" not in load_state_dict(step3)  # tied embeddings are saved as HF does
    before, after = load_causal_lm(str(tiny_model)), load_causal_lm(str(step3))
    assert not torch.equal(before.model.embed_tokens.weight, after.model.embed_tokens.weight)
    assert after.lm_head.weight is after.model.embed_tokens.weight
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("loss", "grad_norm", "lr", "mismatch_kl", "clipped_fraction", "entropy", "tokens_per_s", "time_step",
                "time_wait_batch", "peak_memory_gib", "skipped"):
        assert all(r[key] is not None for r in records), key
    assert records[0]["entropy"] == pytest.approx(math.log(260), rel=0.01)  # a random init is near uniform


def test_weights_keep_prunes_old_folders(tiny_model, tmp_path):
    assert run_trainer("--model.name", str(tiny_model), "--data.fake", "--max-steps", "4", "--output-dir", str(tmp_path),
                       "--seq-len", "32", "--weights.keep", "2") == 0
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step_3", "step_4"]


def reference_aipo_loss(model_folder, rows, num_loss_tokens) -> float:
    """Step 1's loss recomputed from the model folder with full logits, token by token."""
    model = load_causal_lm(str(model_folder))
    total = 0.0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row.input_ids])
            logits = model.lm_head(model(ids, torch.tensor([row.position_ids])))[0]
            for t, is_loss in enumerate(row.loss_mask):
                if is_loss:
                    lp = torch.log_softmax(logits[t - 1] / row.temperatures[t], -1)[row.input_ids[t]].item()
                    total += -min(math.exp(lp - row.logprobs[t]), 8.0) * row.advantages[t]
    return total / num_loss_tokens


def test_trains_on_rollout_files_with_the_wire_alignment(tiny_model, tmp_path):
    gen = torch.Generator().manual_seed(0)
    rows = [random_row(gen, [(5, 6), (3, 9)]), random_row(gen, [(4, 12)])]
    write_rollouts(tmp_path, 1, rows)
    assert run_trainer("--model.name", str(tiny_model), "--max-steps", "1", "--output-dir", str(tmp_path), "--seq-len", "64",
                       "--data.wait-timeout-s", "5") == 0
    assert losses(tmp_path)[1] == pytest.approx(reference_aipo_loss(tiny_model, rows, 6 + 9 + 12), rel=1e-5)
    assert (weights_dir(tmp_path, 1) / STABLE).is_file()


def test_nan_guard_skips_the_step_and_training_goes_on(tiny_model, tmp_path):
    gen = torch.Generator().manual_seed(0)
    for step in (1, 2, 3):
        # Step 2's advantages are finite but overflow fp32 once summed: the loss and gradients blow up.
        write_rollouts(tmp_path, step, [random_row(gen, [(4, 8)], advantage_scale=3e38 if step == 2 else 1.0)])
    assert run_trainer("--model.name", str(tiny_model), "--max-steps", "3", "--output-dir", str(tmp_path), "--seq-len", "32",
                       "--optim.lr", "1e-3", "--data.wait-timeout-s", "5") == 0
    records = metrics(tmp_path)
    assert [r["skipped"] for r in records] == [0, 1, 0]
    assert records[1]["grad_norm"] is None  # NaN, written as null
    assert digest(weights_dir(tmp_path, 2)) == digest(weights_dir(tmp_path, 1)) != digest(weights_dir(tmp_path, 3))
    assert math.isfinite(records[2]["loss"])


@pytest.mark.parametrize("loss_args", [
    ["--loss.type", "dppo_kl", "--loss.kl-tau", "0.01"],
    ["--loss.type", "ppo_clip", "--loss.clip-high", "0.28"],
    ["--loss.type", "custom", "--loss.path", "my_rl_loss:pg", "--loss.kwargs", "{scale = 2.0}"],
    ["--optim.type", "sgd", "--optim.momentum", "0.9", "--scheduler.type", "linear", "--scheduler.warmup-steps", "1"],
], ids=["dppo_kl", "ppo_clip", "custom", "sgd-linear"])
def test_each_loss_and_optimizer_trains(tiny_model, tmp_path, monkeypatch, loss_args):
    from tandem.trainer.loss import LossOutput

    module = types.ModuleType("my_rl_loss")
    module.pg = lambda x, scale: LossOutput(-scale * x.logprobs * x.advantages)
    monkeypatch.setitem(sys.modules, "my_rl_loss", module)
    assert run_trainer("--model.name", str(tiny_model), "--data.fake", "--max-steps", "2", "--output-dir", str(tmp_path),
                       "--seq-len", "32", "--optim.lr", "1e-3", *loss_args) == 0
    records = metrics(tmp_path)
    assert len(records) == 2 and all(math.isfinite(r["loss"]) and r["skipped"] == 0 for r in records)
    if "dppo_kl" in loss_args:
        assert "masked_fraction" in records[0]


def test_activation_checkpointing_changes_nothing_but_memory(tiny_model, tmp_path):
    runs = {}
    for mode in ("off", "selective", "full", "every_k"):
        out = tmp_path / mode
        assert run_trainer("--model.name", str(tiny_model), "--data.fake", "--max-steps", "2", "--output-dir", str(out),
                           "--seq-len", "64", "--optim.lr", "1e-3", "--parallel.activation-checkpoint.mode", mode) == 0
        runs[mode] = ([(r["loss"], r["grad_norm"]) for r in metrics(out)], digest(weights_dir(out, 2)))
    assert runs["off"] == runs["selective"] == runs["full"] == runs["every_k"]


def test_resume_continues_bit_for_bit(tiny_model, tmp_path):
    """4 steps in one go == 2 steps, a crash (no batch 3 in time), a resume, and 2 more steps."""
    gen = torch.Generator().manual_seed(0)
    batches = {step: [random_row(gen, [(4, 10), (3, 7)]), random_row(gen, [(6, 14)])] for step in range(1, 5)}
    common = ["--model.name", str(tiny_model), "--max-steps", "4", "--seq-len", "64", "--optim.lr", "3e-3",
              "--scheduler.type", "cosine", "--scheduler.warmup-steps", "1", "--ckpt.enabled", "--ckpt.interval", "2",
              "--data.wait-timeout-s", "0.5"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for step, rows in batches.items():
        write_rollouts(straight, step, rows)
    assert run_trainer(*common, "--output-dir", str(straight)) == 0

    for step in (1, 2):
        write_rollouts(resumed, step, batches[step])
    assert run_trainer(*common, "--output-dir", str(resumed)) == 1  # waits for batch 3 in vain
    assert [s for s, _ in complete_checkpoints(resumed)] == [2]
    for step in (3, 4):
        write_rollouts(resumed, step, batches[step])
    assert run_trainer(*common, "--output-dir", str(resumed), "--ckpt.resume") == 0

    a, b = metrics(straight), metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    keys = ("loss", "grad_norm", "lr", "entropy", "mismatch_kl")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    assert digest(weights_dir(straight, 4)) == digest(weights_dir(resumed, 4))
    assert len({digest(weights_dir(straight, s)) for s in (2, 3, 4)}) == 3  # it did train


def test_resume_picks_the_newest_complete_checkpoint(tiny_model, tmp_path):
    args = ["--model.name", str(tiny_model), "--data.fake", "--seq-len", "32", "--output-dir", str(tmp_path),
            "--ckpt.enabled", "--ckpt.interval", "1", "--ckpt.keep", "2"]
    assert run_trainer(*args, "--max-steps", "3") == 0
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 3]
    # Leftovers of a crash mid-save: a tmp folder, and a folder without its state file.
    (checkpoint_dir(tmp_path, 9, "trainer").with_name(".trainer.tmp")).mkdir(parents=True)
    checkpoint_dir(tmp_path, 8, "trainer").mkdir(parents=True)
    assert run_trainer(*args, "--max-steps", "4", "--ckpt.resume") == 0
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4]


def test_resume_step_picks_that_checkpoint(tiny_model, tmp_path):
    """`ckpt.resume_step` (set by `tandem rl --resume` to the step the orchestrator also holds) wins over the newest."""
    args = ["--model.name", str(tiny_model), "--data.fake", "--seq-len", "32", "--output-dir", str(tmp_path),
            "--ckpt.enabled", "--ckpt.interval", "1"]
    assert run_trainer(*args, "--max-steps", "3") == 0
    assert run_trainer(*args, "--max-steps", "4", "--ckpt.resume", "--ckpt.resume-step", "2") == 0
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 3, 4]


def test_a_missing_resume_step_is_a_clear_error(tiny_model, tmp_path, caplog):
    assert run_trainer("--model.name", str(tiny_model), "--data.fake", "--max-steps", "1", "--output-dir", str(tmp_path),
                       "--ckpt.resume", "--ckpt.resume-step", "9") == 1
    assert "`ckpt.resume_step` = 9:" in caplog.text and "no complete trainer checkpoint of that step" in caplog.text


def test_bad_batch_stops_with_a_clear_message(tiny_model, tmp_path, caplog):
    rows = [random_row(torch.Generator().manual_seed(0), [(4, 8)])]
    write_rollouts(tmp_path, 1, rows, num_loss_tokens=99)
    assert run_trainer("--model.name", str(tiny_model), "--max-steps", "1", "--output-dir", str(tmp_path), "--seq-len", "32") == 1
    assert "num_loss_tokens = 99 but the loss masks of all ranks hold 8" in caplog.text
    assert not weights_dir(tmp_path, 1).exists()


def test_missing_model_is_a_clear_error(tmp_path, caplog):
    assert run_trainer("--model.name", str(tmp_path / "nope"), "--data.fake", "--max-steps", "1", "--output-dir", str(tmp_path)) == 1
    assert "cannot start the trainer" in caplog.text and "nope" in caplog.text


def test_resume_without_a_checkpoint_starts_at_step_1(tiny_model, tmp_path, caplog):
    assert run_trainer("--model.name", str(tiny_model), "--data.fake", "--max-steps", "2", "--output-dir", str(tmp_path),
                       "--seq-len", "32", "--ckpt.resume") == 0
    assert "holds no complete checkpoint" in caplog.text
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no GPU exists")
def test_cuda_without_a_gpu_is_a_clear_error(tiny_model, tmp_path, caplog):
    assert run_trainer("--model.name", str(tiny_model), "--data.fake", "--max-steps", "1", "--output-dir", str(tmp_path),
                       "--device", "cuda") == 1
    assert "torch sees no CUDA device" in caplog.text


def test_mixture_of_experts_trains_and_publishes_steps_transformers_loads(tiny_moe_model, tmp_path):
    """Stacked experts train under FSDP; `weights/step_N` stores them per expert, as transformers reads them."""
    from transformers import AutoModelForCausalLM

    assert run_trainer("--model.name", str(tiny_moe_model), "--data.fake", "--max-steps", "2", "--output-dir", str(tmp_path),
                       "--seq-len", "48", "--optim.lr", "1e-2") == 0
    step2 = weights_dir(tmp_path, 2)
    ours, before = load_causal_lm(str(step2)), load_causal_lm(str(tiny_moe_model))
    experts = "model.layers.1.mlp.experts.gate_up_proj"
    assert not torch.equal(ours.state_dict()[experts], before.state_dict()[experts])
    theirs = AutoModelForCausalLM.from_pretrained(step2, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, ours.lm_head(ours(ids, torch.arange(20)[None])), atol=1e-5, rtol=0)
