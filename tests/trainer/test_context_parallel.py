"""Context parallelism on the CPU (gloo, torchrun, 4 ranks): CP = 2 (x FSDP 2) and CP = 4 compute the loss,
entropy and gradients of CP = 1 on packed rows of odd-length documents, also with expert parallelism and
router replay, and for the latent families (GLM-5 with its sparse selection, DeepSeek-V3); the trainer at CP = 2
follows the 1-rank trajectory; bad sizes are clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tandem.monitor.logging import setup_logging
from tandem.trainer.micro_batch import zigzag_indices

from test_distributed import BENCHMARK, torchrun_commands, torchrun_env
from trainer_helpers import metrics, one_thread, run_trainer

HERE = Path(__file__).resolve().parent


def test_zigzag_shards_cover_the_row_once_with_balanced_causal_work():
    length, cp = 48, 4
    shards = [zigzag_indices(length, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(shards)).values, torch.arange(length))
    assert shards[1].tolist() == list(range(6, 12)) + list(range(36, 42))
    # causal work of a shard: keys its queries see, the same on every rank
    assert len({int((s + 1).sum()) for s in shards}) == 1


SIZES = {
    "tiny_model": ["1:1", "2:1", "4:1", "2:1:ulysses"],  # CP:EP[:attention]; CP = 2 on 4 ranks is CP x FSDP = 2 x 2
    "tiny_moe_model": ["1:1", "2:2", "4:2", "2:2:ulysses"],  # with expert parallelism and router replay
    "tiny_glm5_model": ["1:1", "1:2", "2:1", "2:2"],  # gathered latents, DSA over the whole row; EP; CP x EP
    "tiny_deepseek_model": ["1:1", "2:1"],  # MLA without DSA
}


@pytest.fixture(scope="module")
def cp_runs(request, tmp_path_factory) -> dict:
    """Every model's sizes from one launch of 4 ranks, by fixture name."""
    folders = {model: str(request.getfixturevalue(model)) for model in SIZES}
    out = tmp_path_factory.mktemp("cp") / "grads.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(HERE / "cp_gradients.py"), str(out), *(arg for model in SIZES for arg in (folders[model], *SIZES[model]))]
    result = subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = torch.load(out, weights_only=False)
    return {model: runs[folders[model]] for model in SIZES}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(SIZES))
def test_context_parallel_sizes_give_the_loss_and_gradients_of_cp_1(model, cp_runs):
    runs, sizes = cp_runs[model], SIZES[model]
    assert sorted(runs) == sorted(sizes)
    ref = runs["1:1"]
    if ref["router"] is not None:  # every token of the four rows counted k times in each MoE layer
        assert {sum(layer) for layer in ref["router"]["router/tokens_per_expert"]} == {(37 + 26 + 26 + 29) * 2}
    assert ref["loss"] != 0 and all(g.abs().max() > 0 for g in ref["grads"].values())
    for size in sizes[1:]:
        run = runs[size]
        assert run["loss"] == pytest.approx(ref["loss"], abs=1e-5), size
        assert run["entropy"] == pytest.approx(ref["entropy"], abs=1e-5), size
        assert run["grad_norm"] == pytest.approx(ref["grad_norm"], abs=1e-5), size
        assert run["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            assert (run["grads"][name] - grad).abs().max().item() < 1e-5, (size, name)
        if ref["router"] is not None:  # the padding CP adds to each row is not counted
            assert run["router"]["router/tokens_per_expert"] == ref["router"]["router/tokens_per_expert"], size
            assert run["router"]["router/entropy"] == pytest.approx(ref["router"]["router/entropy"], abs=1e-6), size


CP_2_STEPS = {
    "tiny_model": 3,
    # documents of 15 tokens, past index_topk: the trajectory leaves 1e-5 at step 3 from gradients 1e-7 apart at step 1
    "tiny_glm5_model": 2,
}


def trainer_args(model: Path, steps: int) -> list[str]:
    return ["--model.name", str(model), "--data.fake", "--data.fake-rows", "2", "--data.fake-samples-per-row", "3",
            "--max-steps", str(steps), "--seq-len", "46", "--optim.lr", "3e-3", "--device", "cpu"]


def sft_args(model: Path, data: Path) -> list[str]:
    return ["--model.name", str(model), "--data.path", str(data), "--seq-len", "90", "--data.rows-per-step", "2",
            "--optim.lr", "3e-3", "--data.eval-fraction", "0.1", "--eval.interval", "3", "--max-steps", "3"]


LONG_SEQUENCE = [str(BENCHMARK), "--preset", "tiny", "--device", "cpu", "--max-position-embeddings", "16384",
                 "--shapes", "1024:1:2", "--steps", "1", "--warmup", "1", "--ac", "selective", "--chunk-size", "256"]
"""benchmarks/trainer.py's long-sequence options at a CPU size: a YaRN-extended preset."""


@pytest.fixture(scope="module")
def cp_2_runs(request, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """(one rank, CP = 2) run folders of each model's trainer and of SFT on the tiny model, and the long-sequence
    benchmark's reports (`benchmark`: one rank with its transformers baseline, `--cp 2`): the CP = 2 runs from one
    launch of 2 ranks, the one-rank runs beside it."""
    from test_sft import reverse_text_data, sft

    root = tmp_path_factory.mktemp("cp2")
    models = {model: request.getfixturevalue(model) for model in CP_2_STEPS}
    train = reverse_text_data(root / "train.jsonl", 40, seed=0)
    runs = {name: (root / name / "one", root / name / "cp2") for name in (*CP_2_STEPS, "sft")}
    runs["benchmark"] = (root / "benchmark-one.json", root / "benchmark-cp2.json")
    commands = [["trainer", *trainer_args(models[m], CP_2_STEPS[m]), "--output-dir", runs[m][1], "--parallel.cp", "2"]
                for m in CP_2_STEPS]
    commands.append(["sft", *sft_args(models["tiny_model"], train), "--device", "cpu", "--output-dir", runs["sft"][1],
                     "--parallel.cp", "2"])
    commands.append({"script": LONG_SEQUENCE[0], "argv": [*LONG_SEQUENCE[1:], "--cp", "2", "--out", runs["benchmark"][1]]})
    with ThreadPoolExecutor() as pool:  # the ranks run beside the one-rank runs (test_distributed says why)
        launched = pool.submit(torchrun_commands, *commands, nproc=2)
        with one_thread():
            for m in CP_2_STEPS:
                assert run_trainer(*trainer_args(models[m], CP_2_STEPS[m]), "--output-dir", str(runs[m][0])) == 0
            assert sft(*sft_args(models["tiny_model"], train), "--output-dir", str(runs["sft"][0])) == 0
        one = subprocess.run([sys.executable, *LONG_SEQUENCE, "--baseline", "1024:1:2", "--out", str(runs["benchmark"][0])],
                             env=torchrun_env(), capture_output=True, text=True, timeout=300)
        result = launched.result()
    assert one.returncode == 0, one.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("model", list(CP_2_STEPS))
def test_cp_2_trains_like_one_rank(model, cp_2_runs):
    """The loop's wiring: each rank reads its own fake rows, the `cp` group trains them all, sharded."""
    one, cp2 = cp_2_runs[model]
    assert len({m["loss"] for m in metrics(one)}) == CP_2_STEPS[model]  # the trajectory moves
    for key in ("loss", "grad_norm", "entropy", "num_loss_tokens"):
        assert [m[key] for m in metrics(cp2)] == pytest.approx([m[key] for m in metrics(one)], abs=1e-5), key

@pytest.mark.parametrize("model, options, message", [
    ("tiny_model", ["--parallel.cp", "2"], "`parallel.cp` = 2 must divide the world size 1"),
    ("tiny_model", ["--parallel.cp", "4", "--parallel.cp-attention", "ulysses"],  # from config.json before the ranks join
     "`parallel.cp` = 4 with `parallel.cp_attention` = 'ulysses' splits the key/value heads, but `num_key_value_heads` = 2 "
     "in {folder}/config.json does not divide by it"),
    ("tiny_glm5_model", ["--parallel.cp", "2", "--parallel.cp-attention", "ulysses"],
     "`parallel.cp_attention` = 'ulysses' splits key/value heads over the `parallel.cp` ranks, but {folder}/config.json "
     "has model_type 'glm_moe_dsa' (latent attention"),
])
def test_bad_context_parallel_sizes_are_clear_errors(model, options, message, request, tmp_path, caplog, monkeypatch):
    folder = request.getfixturevalue(model)
    monkeypatch.setattr(setup_logging("trainer").parent, "propagate", True)  # let caplog see tandem's records
    args = ["--model.name", str(folder), "--data.fake", "--max-steps", "1", "--output-dir", str(tmp_path), *options]
    assert run_trainer(*args) == 1
    assert message.format(folder=folder) in caplog.text


@pytest.mark.slow
def test_long_sequence_benchmark_runs_yarn_and_context_parallel_on_the_cpu(cp_2_runs):
    """benchmarks/trainer.py's long-sequence options at a CPU size: a YaRN-extended preset trains the step
    transformers' model trains, and `--cp 2` under torchrun trains the same rows."""
    one, two = cp_2_runs["benchmark"]
    report = json.loads(one.read_text())
    assert report["max_position_embeddings"] == 16384
    tandem, baseline = report["runs"]
    (cp2,) = json.loads(two.read_text())["runs"]
    assert cp2["options"]["cp"] == 2 and cp2["world_size"] == 2
    assert baseline["losses"][0]["loss"] == pytest.approx(tandem["losses"][0]["loss"], abs=1e-5)
    assert [x["loss"] for x in cp2["losses"]] == pytest.approx([x["loss"] for x in tandem["losses"]], abs=1e-5)
    assert [x["grad_norm"] for x in cp2["losses"]] == pytest.approx([x["grad_norm"] for x in tandem["losses"]], abs=1e-5)


@pytest.mark.slow
def test_sft_at_cp_2_trains_and_evaluates_like_one_rank(cp_2_runs):
    one, cp2 = cp_2_runs["sft"]
    ref, got = metrics(one, "sft"), metrics(cp2, "sft")
    assert "eval_loss" in ref[-1]
    for key in ("loss", "grad_norm", "num_loss_tokens"):
        assert [m[key] for m in got] == pytest.approx([m[key] for m in ref], abs=1e-5), key
    assert got[-1]["eval_loss"] == pytest.approx(ref[-1]["eval_loss"], abs=1e-5)
