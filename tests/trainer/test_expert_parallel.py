"""Expert parallelism on the CPU (gloo, torchrun, 4 ranks) with the tiny-moe preset (and for the losses and
gradients, GLM-4.5's and GLM-5's): EP = 2 and 4 compute the losses and gradients of EP = 1, train the same trajectory, and DCP checkpoints taken at EP = 2
resume at EP = 1 and EP = 4."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem.monitor.logging import setup_logging
from tandem.transport.paths import weights_dir

from test_distributed import torchrun_commands, torchrun_trainer
from trainer_helpers import losses, metrics, one_thread, run_trainer

HERE = Path(__file__).resolve().parent


MODELS = ["tiny_moe_model", "tiny_glm_model", "tiny_glm5_model"]
"""GLM-4.5: a shared expert, a grouped sigmoid router; GLM-5: its routing under latent attention and DSA, and an MTP
layer (whose experts stay whole) published beside the split ones."""


def trainer_args(model: Path) -> list[str]:
    return ["--model.name", str(model), "--data.fake", "--data.fake-rows", "4", "--data.fake-samples-per-row", "2",
            "--max-steps", "3", "--seq-len", "32", "--optim.lr", "3e-3", "--device", "cpu",
            "--ckpt.enabled", "--ckpt.interval", "1", "--ckpt.keep", "3"]


@pytest.fixture(scope="module")
def ep_launch(request, tiny_moe_model, tmp_path_factory) -> dict:
    """One launch of 4 ranks, after the one-rank trainer run rather than beside it (on CI's 2 cores the overlap
    cost more CPU than it saved time: benchmarks/RESULTS.md): every model's expert-parallel sizes (`grads`, by
    fixture name), then EP = 2 trains and its checkpoint of step 1 resumes at EP = 4 (`runs`: the run folders)."""
    folders = {model: str(request.getfixturevalue(model)) for model in MODELS}
    root = tmp_path_factory.mktemp("ep")
    runs = {name: root / name for name in ("one", "ep2", "ep4")}
    commands = ({"script": HERE / "ep_gradients.py", "argv": [root / "grads.pt", *folders.values()]},
                ["trainer", *trainer_args(tiny_moe_model), "--output-dir", runs["ep2"], "--parallel.ep", "2"],
                {"copy": [runs["ep2"] / "checkpoints" / "step_1", runs["ep4"] / "checkpoints" / "step_1"]},
                ["trainer", *trainer_args(tiny_moe_model), "--output-dir", runs["ep4"], "--ckpt.resume", "--parallel.ep", "4"])
    assert run_trainer(*trainer_args(tiny_moe_model), "--output-dir", str(runs["one"])) == 0
    result = torchrun_commands(*commands, nproc=4)
    assert result.returncode == 0, result.stderr[-3000:]
    grads = torch.load(root / "grads.pt", weights_only=False)
    return {"grads": {model: grads[folders[model]] for model in MODELS}, "runs": runs}


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_expert_parallel_sizes_give_the_gradients_of_ep_1(model, ep_launch):
    runs = ep_launch["grads"][model]
    assert sorted(runs) == [1, 2, 4]
    ref = runs[1]
    expert_names = [n for n in ref["grads"] if "experts" in n]
    assert expert_names and all(ref["grads"][n].abs().max() > 0 for n in expert_names)  # the experts learn
    for ep in (2, 4):
        assert runs[ep]["published"].keys() == ref["published"].keys()
        for name, tensor in ref["published"].items():  # gathered from EP shards: the very same weights
            assert torch.equal(runs[ep]["published"][name], tensor), (ep, name)
        assert runs[ep]["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert runs[ep]["grad_norm"] == pytest.approx(ref["grad_norm"], abs=1e-5)
        assert runs[ep]["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            assert runs[ep]["grads"][name].shape == grad.shape, name
            assert (runs[ep]["grads"][name] - grad).abs().max().item() < 1e-5, (ep, name)


@pytest.mark.slow
def test_ep_2_trains_like_ep_1_and_its_checkpoint_resumes_at_ep_1_and_4(tiny_moe_model, ep_launch, tmp_path):
    one, ep2, ep4, ep1 = ep_launch["runs"]["one"], ep_launch["runs"]["ep2"], ep_launch["runs"]["ep4"], tmp_path / "ep1"
    ref = losses(one)
    assert len(set(ref.values())) == 3  # the trajectory moves
    assert losses(ep2) == pytest.approx(ref, abs=1e-5)
    assert [m["grad_norm"] for m in metrics(ep2)] == pytest.approx([m["grad_norm"] for m in metrics(one)], abs=1e-5)
    # Router statistics are summed over the 4 ranks: the same counts as one rank holding every row.
    assert [m["router/tokens_per_expert"] for m in metrics(ep2)] == [m["router/tokens_per_expert"] for m in metrics(one)]
    assert_same_weights(one, ep2, step=3)

    # EP = 2's checkpoint of step 1, resumed at EP = 1 (one rank) too.
    shutil.copytree(ep2 / "checkpoints" / "step_1", ep1 / "checkpoints" / "step_1")
    assert run_trainer(*trainer_args(tiny_moe_model), "--output-dir", str(ep1), "--ckpt.resume") == 0
    for out in (ep4, ep1):
        assert sorted(losses(out)) == [2, 3]
        assert losses(out) == pytest.approx({s: ref[s] for s in (2, 3)}, abs=1e-5), out.name
        assert_same_weights(one, out, step=3)


@pytest.mark.slow
def test_bias_update_is_the_same_on_two_expert_parallel_ranks_as_on_one(tiny_minimax_model, tmp_path):
    """MiniMax-M2's block-level score correction bias, updated from the load of all ranks."""
    common = ["--model.name", str(tiny_minimax_model), "--data.fake", "--data.fake-rows", "2", "--max-steps", "2",
              "--seq-len", "32", "--device", "cpu", "--router.bias-update-rate", "0.01"]
    one, two = tmp_path / "one", tmp_path / "two"
    with ThreadPoolExecutor() as pool:  # the ranks run beside the one-rank run (test_distributed says why)
        launched = pool.submit(torchrun_trainer, *common, "--output-dir", str(two), "--parallel.ep", "2", nproc=2)
        with one_thread():
            assert run_trainer(*common, "--output-dir", str(one)) == 0
        result = launched.result()
    assert result.returncode == 0, result.stderr[-3000:]
    wa, wb = (load_file(weights_dir(run, 2) / "model.safetensors") for run in (one, two))
    biases = [k for k in wa if k.endswith("e_score_correction_bias")]
    assert biases and all(wa[k].abs().max() > 0 for k in biases)  # the update moved them
    for k in biases:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=0)


def assert_same_weights(a: Path, b: Path, step: int) -> None:
    """Published weights of two runs: same names and shapes, values within Adam's fp32 noise (see test_distributed)."""
    wa, wb = load_file(weights_dir(a, step) / "model.safetensors"), load_file(weights_dir(b, step) / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert any("experts" in k for k in wa)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4


@pytest.mark.parametrize("model, ep, message", [
    ("tiny_moe_model", 3, "`parallel.ep` = 3 does not divide the model's expert count (`num_local_experts` = 8 in {folder}/config.json)"),
    ("tiny_model", 2, "`parallel.ep` = 2 but {folder}/config.json has no routed experts"),
    ("tiny_moe_model", 2, "`parallel.ep` = 2 must divide the world size 1"),
])
def test_bad_expert_parallel_size_is_a_clear_error(model, ep, message, request, tmp_path, caplog, monkeypatch):
    folder = request.getfixturevalue(model)
    monkeypatch.setattr(setup_logging("trainer").parent, "propagate", True)  # let caplog see tandem's records
    args = ["--model.name", str(folder), "--data.fake", "--max-steps", "1", "--output-dir", str(tmp_path), "--parallel.ep", str(ep)]
    assert run_trainer(*args) == 1
    assert message.format(folder=folder) in caplog.text
