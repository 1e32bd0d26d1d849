"""Training the multi-token prediction layer (`mtp.train`, `tandem.trainer.mtp`): its loss is the cross-entropy of its
own forward within each document, it learns, and the policy trains bit for bit as with the layer frozen."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.distributed.fsdp import FSDPModule

from tandem.config.base import ModelConfig
from tandem.config.loader import ConfigError, parse_args
from tandem.config.sft import SFTConfig
from tandem.config.trainer import AdamWConfig, ConstantSchedule, MultiTokenPredictionConfig, ParallelConfig
from tandem.models.presets import PRESETS, init_model, shape_config, write_model
from tandem.models.weights import weight_files
from tandem.trainer.checkpoint import load_checkpoint, save_checkpoint
from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.model import build_policy
from tandem.trainer.mtp import check_mtp_trainable
from tandem.trainer.optim import build_optimizer, build_scheduler
from tandem.trainer.parallel.dims import close_parallel, init_parallel
from tandem.trainer.sft.train import sft_objective
from tandem.trainer.step import count_loss_tokens, train_step

from test_distributed import torchrun_trainer
from trainer_helpers import metrics, one_thread, random_row, run_trainer

STEPS = 4


@pytest.fixture(scope="module")
def tiny_glm5(tmp_path_factory):
    return init_model("tiny-glm5", tmp_path_factory.mktemp("models") / "tiny-glm5", seed=0)


@pytest.fixture(scope="module", params=["tiny-glm5", "tiny-with-head"])
def with_mtp(request, tmp_path_factory):
    """A model with one MTP layer: GLM-5's own, or a Qwen3 draft head (`tandem model init --draft-head`)."""
    if request.param == "tiny-glm5":
        return request.getfixturevalue("tiny_glm5")
    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny-with-head", seed=0, draft_head=True)


@pytest.fixture
def dims():
    d = init_parallel("cpu")
    yield d
    close_parallel()


def rows(device: torch.device) -> list[MicroBatch]:
    """Two packed rows, the first of two documents (prompt, completion): the second's prompt is one token, so its
    first completion token has a position two before it only in the document before."""
    gen = torch.Generator().manual_seed(0)
    return [MicroBatch.from_row(random_row(gen, [(5, 11), (1, 9)]), device), MicroBatch.from_row(random_row(gen, [(3, 14)]), device)]


def policy_of(folder, dims, train: bool, fsdp: bool = False):
    policy, _ = build_policy(ModelConfig(name=str(folder)), ParallelConfig(fsdp_at_one_rank=fsdp), dims, chunk_size=5,
                             mtp=MultiTokenPredictionConfig(train=train))
    return policy


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-deepseek-v3", "tiny-with-head", "tiny-glm4-moe-mtp"])
def test_the_mtp_loss_is_the_cross_entropy_of_the_layers_own_forward_document_by_document(preset, dims, tmp_path):
    """The reference runs each document of the packed row alone (so nothing can cross a boundary) and takes the
    cross-entropy of token t+2 in fp64, on the loss tokens. GLM-4.5's layer is a routed block."""
    if preset == "tiny-with-head":
        folder = init_model("tiny", tmp_path / preset, draft_head=True)
    elif preset == "tiny-glm4-moe-mtp":
        folder = write_model(shape_config(dict(PRESETS["tiny-glm4-moe"], num_nextn_predict_layers=1)), tmp_path / preset)
    else:
        folder = init_model(preset, tmp_path / preset)
    policy = policy_of(folder, dims, train=True)
    mb = rows(dims.device)[0]
    out = policy(mb.input_ids, mb.position_ids, mb.temperatures, mb.loss_mask, mb.row_document_lengths)
    lm = policy.lm
    expected, count, start = torch.zeros((), dtype=torch.float64), 0, 0
    with torch.no_grad():
        for length in mb.row_document_lengths[0]:
            ids = mb.input_ids[:, start:start + length]
            positions, mask = mb.position_ids[:, start:start + length], mb.loss_mask[0, start:start + length]
            draft = lm.predict_after_next(lm(ids, positions), ids.roll(-1, 1), positions)[0]
            logprobs = F.log_softmax(F.linear(draft, lm.lm_head.weight).double(), dim=-1)
            for t in range(length - 2):
                if mask[t + 2]:
                    expected -= logprobs[t, ids[0, t + 2]]
                    count += 1
            start += length
    assert count == 11 + 9 - 1  # not the second document's first completion token: across the boundary
    assert int(out.mtp.num_tokens) == count
    torch.testing.assert_close(out.mtp.loss_sum.double(), expected, rtol=1e-5, atol=1e-5)


def train(policy, dims, batches) -> list:
    optimizer = build_optimizer(policy, AdamWConfig(lr=3e-3, max_grad_norm=0.05))  # the policy's clipping is active
    scheduler = build_scheduler(optimizer, ConstantSchedule(), STEPS)
    n = count_loss_tokens(batches, dims)
    results = []
    for _ in range(STEPS):
        results.append(train_step(policy, optimizer, scheduler, batches, sft_objective, n, 0.05, dims))
        results[-1].trunk = {name: p.detach().clone() for name, p in policy.hf_named_parameters() if "mtp_layers" not in name}
    return results


def test_the_layer_learns_while_the_policy_trains_bit_for_bit_as_with_it_frozen(with_mtp, dims):
    batches = rows(dims.device)
    frozen, trained = policy_of(with_mtp, dims, train=False), policy_of(with_mtp, dims, train=True)
    mtp_before = {name: p.detach().clone() for name, p in trained.hf_named_parameters() if "mtp_layers" in name}
    with_frozen, with_trained = train(frozen, dims, batches), train(trained, dims, batches)
    for off, on in zip(with_frozen, with_trained):
        assert on.loss == off.loss and on.grad_norm == off.grad_norm and not on.skipped
        assert on.trunk.keys() == off.trunk.keys()
        assert all(torch.equal(on.trunk[name], off.trunk[name]) for name in off.trunk)
        assert "mtp/loss" not in off.metrics and on.metrics["mtp/grad_norm"] > 0
    mtp_losses = [r.metrics["mtp/loss"] for r in with_trained]
    assert mtp_losses[-1] < mtp_losses[0] - 0.05, mtp_losses
    after = {name: p.detach() for name, p in trained.hf_named_parameters() if "mtp_layers" in name}
    unchanged = {name for name in after if torch.equal(after[name], mtp_before[name])}
    assert unchanged == {name for name in after if ".indexer." in name or "e_score_correction_bias" in name}
    assert all(torch.equal(p, mtp_before[name]) for name, p in frozen.hf_named_parameters() if "mtp_layers" in name)


def test_fsdp_at_one_rank_trains_the_layer_as_the_plain_path_does(with_mtp, dims):
    """Under FSDP the layer is a group of its own whose `predict` gathers it, trained or frozen (in the root's group
    a frozen layer would stay gathered through every step); the numbers are the plain path's."""
    batches = rows(dims.device)
    sharded_policy = policy_of(with_mtp, dims, True, fsdp=True)
    assert isinstance(sharded_policy.lm.model.mtp_layers[0], FSDPModule)
    assert isinstance(policy_of(with_mtp, dims, False, fsdp=True).lm.model.mtp_layers[0], FSDPModule)
    plain, sharded = train(policy_of(with_mtp, dims, True), dims, batches), train(sharded_policy, dims, batches)
    for a, b in zip(plain, sharded):
        assert a.loss == b.loss
        assert a.metrics["mtp/loss"] == pytest.approx(b.metrics["mtp/loss"], rel=1e-6)
        assert a.metrics["mtp/grad_norm"] == pytest.approx(b.metrics["mtp/grad_norm"], rel=1e-5)


def test_a_resumed_run_trains_the_layer_as_an_unbroken_one(with_mtp, dims, tmp_path):
    """The trained layer and its AdamW moments are in the checkpoint (what trains is saved)."""
    batches = rows(dims.device)
    n = count_loss_tokens(batches, dims)

    def trainer():
        policy = policy_of(with_mtp, dims, True)
        optimizer = build_optimizer(policy, AdamWConfig(lr=3e-3))
        return policy, optimizer, build_scheduler(optimizer, ConstantSchedule(), 2)

    def step(policy, optimizer, scheduler) -> float:
        return train_step(policy, optimizer, scheduler, batches, sft_objective, n, 1.0, dims).metrics["mtp/loss"]

    unbroken = trainer()
    expected = [step(*unbroken), step(*unbroken)]
    first = trainer()
    assert step(*first) == expected[0]
    folder = save_checkpoint(tmp_path, 1, *first, {}, dims)
    resumed = trainer()
    load_checkpoint(folder, *resumed, dims)
    assert step(*resumed) == expected[1]
    for (name, a), (_, b) in zip(unbroken[0].hf_named_parameters(), resumed[0].hf_named_parameters()):
        assert torch.equal(a, b), name


def test_the_rl_trainer_logs_the_mtp_loss_and_publishes_the_trained_layer(with_mtp, tmp_path):
    """The real RL trainer on fake rollouts: `mtp/loss` in `metrics.jsonl`, the published layer trained (but for its
    indexer and score biases), under the checkpoints' names (`model.layers.{num_hidden_layers}.` on disk)."""
    from tandem.config.trainer import TrainerConfig
    from tandem.models.weights import load_state_dict
    from tandem.trainer.rl.train import main
    from tandem.transport.paths import weights_dir

    args = ["--device", "cpu", "--model.name", str(with_mtp), "--data.fake", "--data.fake-rows", "1",
            "--data.fake-samples-per-row", "2", "--max-steps", "2", "--seq-len", "40", "--output-dir", str(tmp_path / "run"),
            "--mtp.train", "--optim.lr", "1e-3"]
    assert main(parse_args(TrainerConfig, args, environ={})) == 0
    logged = metrics(tmp_path / "run")
    assert len(logged) == 2 and all(math.isfinite(r["mtp/loss"]) and r["mtp/grad_norm"] > 0 for r in logged)
    before, after = load_state_dict(with_mtp), load_state_dict(weights_dir(tmp_path / "run", 2))
    layer = {name for name in before if name.startswith("model.mtp_layers.0.")}
    assert layer and layer <= after.keys()
    num_layers = json.loads((with_mtp / "config.json").read_text())["num_hidden_layers"]
    on_disk = {k for file in weight_files(weights_dir(tmp_path / "run", 2)) for k in load_file(file)}
    assert {k for k in on_disk if ".mtp_layers." in k} == set()
    assert {f"model.layers.{num_layers}.{name.split('.', 3)[3]}" for name in layer if ".experts." not in name} <= on_disk
    unchanged = {name for name in layer if torch.equal(before[name], after[name])}
    assert unchanged == {name for name in layer if ".indexer." in name or "e_score_correction_bias" in name}


@pytest.mark.slow
def test_two_ranks_train_the_layer_as_one_rank_does(tiny_glm5, tmp_path):
    """World size 2 (torchrun, gloo, FSDP: the layer a group of its own, gathered around `predict`) against the
    one-rank path, on the same global batch."""
    common = ["--model.name", str(tiny_glm5), "--data.fake", "--data.fake-rows", "4", "--data.fake-samples-per-row", "2",
              "--max-steps", "3", "--seq-len", "48", "--optim.lr", "3e-3", "--device", "cpu", "--mtp.train"]
    with ThreadPoolExecutor() as pool:
        launched = pool.submit(torchrun_trainer, *common, "--output-dir", str(tmp_path / "two"))
        with one_thread():
            assert run_trainer(*common, "--output-dir", str(tmp_path / "one")) == 0
        result = launched.result()
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["mtp/loss"] == pytest.approx(a["mtp/loss"], abs=1e-5)
    assert one[-1]["mtp/loss"] != one[0]["mtp/loss"]


def test_a_model_without_mtp_layers_is_refused_naming_the_key_and_file(tiny_model, dims):
    with pytest.raises(ValueError, match=f"`mtp.train` = true but {tiny_model / 'config.json'} has 0 multi-token"):
        policy_of(tiny_model, dims, train=True)


def test_mtp_training_under_expert_parallelism_is_refused(tiny_glm5):
    from tandem.models.loading import load_causal_lm

    with pytest.raises(ValueError, match="`mtp.train` with `parallel.ep` = 2: .* set `parallel.ep` = 1"):
        check_mtp_trainable(load_causal_lm(str(tiny_glm5)), 2, str(tiny_glm5 / "config.json"))


def test_mtp_training_with_context_parallelism_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match="`mtp.train` with `parallel.cp` = 2: .* set `parallel.cp` = 1 or `mtp.train` = false"):
        parse_args(SFTConfig, ["--model.name", "m", "--data.path", "d.jsonl", "--mtp.train", "--parallel.cp", "2"], environ={})


def test_mtp_training_with_lora_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match="`mtp.train` with `lora.enabled`.*from the command line"):
        parse_args(SFTConfig, ["--model.name", "m", "--data.path", "d.jsonl", "--mtp.train", "--lora.enabled"], environ={})
