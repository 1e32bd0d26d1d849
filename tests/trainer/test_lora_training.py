"""LoRA in the trainers: only adapters train, checkpoint, resume and publish; FSDP and the one-rank path agree."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tandem.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter_folder
from tandem.models.presets import init_model
from tandem.models.weights import load_state_dict
from tandem.trainer.checkpoint import complete_checkpoints
from tandem.transport.paths import STABLE, weights_dir

from test_distributed import torchrun_trainer
from test_sft import reverse_text_data, sft
from trainer_helpers import losses, metrics, one_thread, random_row, run_trainer, write_rollouts

LORA = ["--lora.enabled", "--lora.rank", "4", "--lora.alpha", "8"]


def rollouts(folder, steps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        write_rollouts(folder, step, [random_row(gen, [(4, 10), (3, 7)]), random_row(gen, [(6, 14)])])


def test_only_adapters_train_publish_and_checkpoint(tiny_model, tmp_path):
    out = tmp_path / "run"
    rollouts(out, 3)
    assert run_trainer("--model.name", str(tiny_model), "--max-steps", "3", "--seq-len", "64", "--optim.lr", "1e-2",
                       "--output-dir", str(out), "--ckpt.enabled", "--ckpt.interval", "3", *LORA) == 0
    folder = weights_dir(out, 3)
    assert {p.name for p in folder.iterdir()} == {ADAPTER_CONFIG, ADAPTER_WEIGHTS, STABLE}
    spec, adapters = read_adapter_folder(folder)
    assert (spec.rank, spec.alpha) == (4, 8.0)
    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    assert len(adapters) == 2 * 7 * layers and all(".lora_" in name for name in adapters)
    assert any(name.endswith("lora_B.weight") and t.abs().sum() > 0 for name, t in adapters.items())  # B left zero
    # step 1 published adapters that differ from step 3's: the policy moved
    _, first = read_adapter_folder(weights_dir(out, 1))
    assert any(not torch.equal(first[n], adapters[n]) for n in adapters)
    # the checkpoint holds the adapters and their optimizer state, never the frozen base
    [(_, ckpt)] = complete_checkpoints(out)
    saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert model_keys == {f"lm.{name}" for name in adapters}, sorted(model_keys)[:4]
    assert not any("embed_tokens" in k or k.endswith("q_proj.weight") for k in saved)
    assert all(r["grad_norm"] > 0 for r in metrics(out))


def test_lora_resumes_bit_for_bit_and_only_on_its_base(tiny_model, tmp_path):
    common = ["--model.name", str(tiny_model), "--max-steps", "4", "--seq-len", "64", "--optim.lr", "1e-2",
              "--ckpt.enabled", "--ckpt.interval", "2", "--data.wait-timeout-s", "0.5", *LORA]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    rollouts(straight, 4)
    assert run_trainer(*common, "--output-dir", str(straight)) == 0
    rollouts(resumed, 2)
    assert run_trainer(*common, "--output-dir", str(resumed)) == 1  # waits for batch 3 in vain
    rollouts(resumed, 4)
    assert run_trainer(*common, "--output-dir", str(resumed), "--ckpt.resume") == 0
    keys = ("loss", "grad_norm", "entropy")
    assert [[r[k] for k in keys] for r in metrics(straight)] == [[r[k] for k in keys] for r in metrics(resumed)]
    _, a = read_adapter_folder(weights_dir(straight, 4))
    _, b = read_adapter_folder(weights_dir(resumed, 4))
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_lora_checkpoint_is_refused_on_another_base(tiny_model, tmp_path, caplog):
    other = init_model("tiny", tmp_path / "other", seed=1)
    out = tmp_path / "run"
    args = ["--data.fake", "--seq-len", "32", "--output-dir", str(out), "--ckpt.enabled", "--ckpt.interval", "1", *LORA]
    assert run_trainer("--model.name", str(tiny_model), "--max-steps", "1", *args) == 0
    assert run_trainer("--model.name", str(other), "--max-steps", "2", "--ckpt.resume", *args) == 1
    assert f"was trained on {tiny_model} (sha256 " in caplog.text and f"this run's model is {other} (sha256 " in caplog.text
    # nor does full fine-tuning resume from adapters
    assert run_trainer("--model.name", str(tiny_model), "--max-steps", "2", "--ckpt.resume", *args[:-len(LORA)]) == 1
    assert "this run's model is no LoRA (full weights)" in caplog.text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: fp32 adapter masters beside a bf16 base
def test_fsdp_and_the_one_rank_path_train_the_same_adapters(tiny_model, tmp_path, dtype):
    for name, extra in (("one_rank", []), ("fsdp", ["--parallel.fsdp-at-one-rank"])):
        rollouts(tmp_path / name, 2)
        assert run_trainer("--model.name", str(tiny_model), "--max-steps", "2", "--seq-len", "64", "--optim.lr", "1e-2",
                           "--output-dir", str(tmp_path / name), "--model.dtype", dtype, *LORA, *extra) == 0
    assert [r["loss"] for r in metrics(tmp_path / "one_rank")] == [r["loss"] for r in metrics(tmp_path / "fsdp")]
    _, a = read_adapter_folder(weights_dir(tmp_path / "one_rank", 2))
    _, b = read_adapter_folder(weights_dir(tmp_path / "fsdp", 2))
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_sft_with_lora_lowers_the_loss_and_leaves_the_base(tiny_model, tmp_path):
    train = reverse_text_data(tmp_path / "train.jsonl", 200, seed=0)
    held_out = reverse_text_data(tmp_path / "eval.jsonl", 20, seed=1)
    out = tmp_path / "run"
    before = load_state_dict(tiny_model)
    assert sft("--model.name", str(tiny_model), "--data.path", str(train), "--data.eval-path", str(held_out),
               "--eval.interval", "10", "--max-steps", "20", "--seq-len", "256", "--data.rows-per-step", "2",
               "--optim.lr", "1e-2", "--output-dir", str(out), "--lora.enabled", "--lora.rank", "8") == 0
    records = metrics(out, "sft")
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    # adapters alone on a random model: the loss falls from uniform (ln 260 = 5.56) by about a fifth in 20 steps
    assert len(evals) == 2 and evals[-1] < evals[0] < 0.9 * records[0]["loss"], (evals, records[0]["loss"])
    assert (out / "weights" / "final" / ADAPTER_CONFIG).is_file()
    after = load_state_dict(tiny_model)
    assert all(torch.equal(before[n], after[n]) for n in before)


EXPERTS = ["--lora.target-modules", '["q_proj", "o_proj"]', "--lora.target-experts", '["gate_up_proj", "down_proj"]']


@pytest.mark.slow
def test_expert_adapters_train_publish_checkpoint_and_split_over_expert_parallel_ranks(tiny_moe_model, tmp_path):
    """Each rank of EP = 2 holds its experts' adapters: the same losses, gradients and published adapters as one rank,
    and its checkpoint resumes on one rank."""
    common = ["--model.name", str(tiny_moe_model), "--data.fake", "--data.fake-rows", "4", "--data.fake-samples-per-row", "2",
              "--max-steps", "3", "--seq-len", "32", "--optim.lr", "1e-2", "--ckpt.enabled", "--ckpt.interval", "2",
              *LORA, *EXPERTS]
    one, ep2 = tmp_path / "one", tmp_path / "ep2"
    with ThreadPoolExecutor() as pool:  # the ranks run beside the one-rank run (test_distributed says why)
        launched = pool.submit(torchrun_trainer, *common, "--device", "cpu", "--output-dir", str(ep2), "--parallel.ep", "2")
        with one_thread():
            assert run_trainer(*common, "--output-dir", str(one)) == 0
        result = launched.result()
    assert result.returncode == 0, result.stderr[-3000:]
    spec, adapters = read_adapter_folder(weights_dir(one, 2))
    assert spec.target_experts == ("gate_up_proj", "down_proj")
    layers = json.loads((tiny_moe_model / "config.json").read_text())["num_hidden_layers"]
    expert_names = [n for n in adapters if n.endswith(("_lora_A", "_lora_B"))]
    assert len(expert_names) == 4 * layers and adapters["model.layers.0.mlp.experts.down_proj_lora_A"].shape == (8, 4, 64)
    assert all(adapters[n].abs().sum() > 0 for n in expert_names if n.endswith("_lora_B"))  # B left zero: the experts learn
    [_, (_, ckpt)] = complete_checkpoints(one)
    saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert {k.removeprefix("model.lm.") for k in saved if k.startswith("model.")} == set(adapters)
    assert losses(ep2) == pytest.approx(losses(one), abs=1e-5)
    assert [m["grad_norm"] for m in metrics(ep2)] == pytest.approx([m["grad_norm"] for m in metrics(one)], abs=1e-5)
    _, sharded = read_adapter_folder(weights_dir(ep2, 2))
    assert sharded.keys() == adapters.keys()
    assert max((sharded[n] - adapters[n]).abs().max().item() for n in adapters) < 1e-4  # Adam's fp32 noise, as test_expert_parallel
    # EP = 2's checkpoint of step 2 (each rank's experts' adapters and their optimizer state), resumed on one rank
    resumed = tmp_path / "resumed"
    shutil.copytree(ep2 / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    assert run_trainer(*common, "--output-dir", str(resumed), "--ckpt.resume") == 0
    assert losses(resumed) == pytest.approx({3: losses(one)[3]}, abs=1e-5)
