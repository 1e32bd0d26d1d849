"""FP8 training (`fp8.enabled`, `tandem.trainer.float8`): which projections become torchao's `Float8Linear`, that
exactly those compute in FP8, that training stays close to bf16, and the refusals.

torchao's float8 matmuls run on this CPU (torch's CPU `_scaled_mm`), so these tests train for real in FP8; only
the trainer's start refuses a CPU (`check_float8_device`), which `build_policy` leaves to its caller.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from tandem.config.base import ModelConfig
from tandem.config.loader import ConfigError, parse_args
from tandem.config.sft import SFTConfig
from tandem.config.trainer import (ActivationCheckpointConfig, AdamWConfig, AIPOLoss, ConstantSchedule, Float8TrainingConfig,
                                   KernelsConfig, ParallelConfig, RolloutDataConfig, TrainerConfig)
from tandem.models.presets import preset_config, write_model
from tandem.trainer import float8
from tandem.trainer.checkpoint import load_checkpoint, save_checkpoint
from tandem.trainer.loss import build_loss
from tandem.trainer.model import build_policy, gather_full_state
from tandem.trainer.optim import build_optimizer, build_scheduler
from tandem.trainer.rl.train import rl_objective
from tandem.trainer.session import open_session
from tandem.trainer.step import count_loss_tokens, train_step

from test_block import traced  # noqa: F401  (a fixture: compile with the aot_eager backend)
from test_one_rank import dims  # noqa: F401  (a fixture: the CPU process group)
from test_stack import ONE_DOCUMENT_ROWS, batches

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
FEED_FORWARD = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def odd_ffn_model(tmp_path_factory) -> Path:
    """The tiny Qwen3 with a feed-forward of 200 features (not a multiple of 16): its attention qualifies, its
    feed-forward does not."""
    config = preset_config("tiny") | {"intermediate_size": 200}
    return write_model(config, tmp_path_factory.mktemp("models") / "tiny-odd-ffn", seed=0)


def fp8_policy(model: Path, dims, recipe: str = "tensorwise", checkpointing: str = "selective", compile: str = "off",
               stack: bool = False, fsdp: bool = False):
    parallel = ParallelConfig(activation_checkpoint=ActivationCheckpointConfig(mode=checkpointing), fsdp_at_one_rank=fsdp)
    policy, _ = build_policy(ModelConfig(name=str(model), dtype="bfloat16"), parallel, dims, chunk_size=4,
                             kernels=KernelsConfig(compile=compile, compile_stack=stack),
                             fp8=Float8TrainingConfig(enabled=recipe != "off", recipe="tensorwise" if recipe == "off" else recipe))
    return policy


def float8_modules(policy) -> set[str]:
    return {name for name, module in policy.lm.named_modules() if isinstance(module, Float8Linear)}


def test_the_blocks_dense_projections_become_float8_and_nothing_else(tiny_glm_model, dims, caplog):
    """GLM-4.5's shape: a dense first block, then mixture-of-experts blocks with a router and a shared expert. Every
    attention projection and the dense block's feed-forward convert; the router, the shared expert, the routed
    experts, the LM head and the embeddings stay as they were."""
    with caplog.at_level(logging.INFO, logger=float8.__name__):
        policy = fp8_policy(tiny_glm_model, dims)
    blocks = policy.blocks
    expected = {f"model.layers.{i}.{name}" for i in range(len(blocks)) for name in ATTENTION}
    expected |= {f"model.layers.0.{name}" for name in FEED_FORWARD}
    assert float8_modules(policy) == expected
    assert type(policy.lm.lm_head) is nn.Linear and type(policy.lm.model.embed_tokens) is nn.Embedding
    for block in list(blocks)[1:]:
        assert all(type(m) is nn.Linear for m in block.mlp.shared_experts.modules() if isinstance(m, nn.Linear))
        assert not any(isinstance(m, Float8Linear) for m in block.mlp.gate.modules())
        assert not any(isinstance(m, Float8Linear) for m in block.mlp.experts.modules())
    assert f"{len(expected)} block projections in FP8, 0 kept" in caplog.text


def test_a_projection_whose_dims_are_not_multiples_of_16_stays_in_the_compute_dtype(odd_ffn_model, dims, caplog):
    with caplog.at_level(logging.INFO, logger=float8.__name__):
        policy = fp8_policy(odd_ffn_model, dims)
    num_blocks = len(policy.blocks)
    assert float8_modules(policy) == {f"model.layers.{i}.{name}" for i in range(num_blocks) for name in ATTENTION}
    assert all(type(getattr(block.mlp, name.split(".")[1])) is nn.Linear for block in policy.blocks for name in FEED_FORWARD)
    assert f"{4 * num_blocks} block projections in FP8, {3 * num_blocks} kept in the compute dtype" in caplog.text
    assert "layers.0.mlp.gate_proj" in caplog.text


@pytest.mark.parametrize("model", ["tiny_model", "odd_ffn_model", "tiny_glm_model"])
def test_exactly_the_float8_modules_compute_in_fp8(model, dims, monkeypatch, request):
    """Every FP8 matmul of a forward is one converted projection's, once each (checkpointing off: no recompute)."""
    policy = fp8_policy(request.getfixturevalue(model), dims, checkpointing="off")
    calls = []
    original = matmul_with_hp_or_float8_args.apply

    def spy(x, weight_t, *args):
        calls.append(tuple(weight_t.shape))
        return original(x, weight_t, *args)
    monkeypatch.setattr(matmul_with_hp_or_float8_args, "apply", spy)
    mbs = batches(ONE_DOCUMENT_ROWS[0], 0, dims.device)
    policy(mbs[0].input_ids, mbs[0].position_ids, mbs[0].temperatures, mbs[0].loss_mask)
    modules = [module for module in policy.lm.modules() if isinstance(module, Float8Linear)]
    assert sorted(calls) == sorted((module.in_features, module.out_features) for module in modules)


class Trainer:
    def __init__(self, model: Path, dims, recipe: str, compile: str = "off", stack: bool = False, fsdp: bool = False):
        self.dims = dims
        self.policy = fp8_policy(model, dims, recipe, compile=compile, stack=stack, fsdp=fsdp)
        self.optimizer = build_optimizer(self.policy, AdamWConfig(lr=3e-3))
        self.scheduler = build_scheduler(self.optimizer, ConstantSchedule(), len(ONE_DOCUMENT_ROWS))
        self.objective = rl_objective(build_loss(AIPOLoss()))

    def step(self, step: int) -> float:
        mbs = batches(ONE_DOCUMENT_ROWS[step], step, self.dims.device)
        return train_step(self.policy, self.optimizer, self.scheduler, mbs, self.objective, count_loss_tokens(mbs, self.dims),
                          0.5, self.dims).loss

    def losses(self) -> list[float]:
        return [self.step(step) for step in range(len(ONE_DOCUMENT_ROWS))]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_training_follows_bf16_closely_but_not_bitwise(tiny_model, dims, recipe):
    """Three bf16 steps at a learning rate of 3e-3, losses of about 0.5 in size (of either sign: AIPO's advantages):
    each FP8 loss within 0.025 of bf16's, and not equal to it (the FP8 matmuls ran). A larger rate makes the third
    step's loss depend on the first steps' roundings more than on the scheme (AdamW's first updates are the
    gradients' signs), and how a CPU's FP8 matmul rounds varies by CPU."""
    reference = Trainer(tiny_model, dims, "off").losses()
    losses = Trainer(tiny_model, dims, recipe).losses()
    assert losses != reference
    assert losses == pytest.approx(reference, abs=2.5e-2)


def test_under_fsdp_tensorwise_gathers_fp8_weights_and_rowwise_trains_as_at_one_rank(tiny_model, dims):
    """FSDP2 (at one rank: the same hooks and gathers as at several). `tensorwise` shards a weight that FSDP gathers in
    FP8, scaled from the fp32 master rather than from its bf16 copy (by scales found after each step), so the losses
    differ from the plain one-rank path's in rounding only; `rowwise` gathers bf16 as without FP8: the one-rank
    path's losses bit for bit."""
    tensorwise = Trainer(tiny_model, dims, "tensorwise", fsdp=True)
    shard = tensorwise.policy.lm.model.layers[0].self_attn.q_proj.weight
    assert type(shard._local_tensor) is WeightWithDynamicFloat8CastTensor
    float8.keep_scales_precomputed(tensorwise.optimizer, tensorwise.policy)
    first_scale = shard._local_tensor._precomputed_scale.clone()
    assert tensorwise.losses() == pytest.approx(Trainer(tiny_model, dims, "tensorwise").losses(), abs=2.5e-2)
    assert not torch.equal(shard._local_tensor._precomputed_scale, first_scale)  # found again after each step
    published = gather_full_state(tensorwise.policy, torch.bfloat16, keep=True)  # what a policy update holds
    assert {type(t) for t in published.values()} == {torch.Tensor}
    rowwise = Trainer(tiny_model, dims, "rowwise", fsdp=True)
    assert type(rowwise.policy.lm.model.layers[0].self_attn.q_proj.weight.to_local()) is torch.Tensor
    assert rowwise.losses() == Trainer(tiny_model, dims, "rowwise").losses()


def test_a_tensorwise_fsdp_checkpoint_resumes_bit_for_bit(tiny_model, dims, tmp_path):
    """DCP saves and loads the weights FSDP gathers in FP8 (torchao's wrapper of each fp32 shard) like plain ones; the
    scales are found again for the loaded weights, as the trainer's start does after a resume."""
    reference = Trainer(tiny_model, dims, "tensorwise", fsdp=True)
    float8.keep_scales_precomputed(reference.optimizer, reference.policy)
    expected = reference.losses()
    saver = Trainer(tiny_model, dims, "tensorwise", fsdp=True)
    float8.keep_scales_precomputed(saver.optimizer, saver.policy)
    assert saver.step(0) == expected[0]
    folder = save_checkpoint(tmp_path, 1, saver.policy, saver.optimizer, saver.scheduler, {}, dims)
    loader = Trainer(tiny_model, dims, "tensorwise", fsdp=True)
    assert load_checkpoint(folder, loader.policy, loader.optimizer, loader.scheduler, dims).step == 1
    float8.keep_scales_precomputed(loader.optimizer, loader.policy)
    assert [loader.step(step) for step in range(1, len(ONE_DOCUMENT_ROWS))] == expected[1:]


@pytest.mark.slow
def test_compiled_as_one_stack_fp8_trains_like_its_blocks_run_eagerly(tiny_model, dims, traced):
    """The float8 matmuls trace into the compiled stack (one graph, no break) and give eager mode's losses."""
    stacked = Trainer(tiny_model, dims, "tensorwise", compile="on", stack=True)
    assert stacked.policy.compiled_stack
    assert stacked.losses() == pytest.approx(Trainer(tiny_model, dims, "tensorwise").losses(), rel=1e-5)


def test_exact_and_lora_are_refused_naming_the_keys_and_the_file(tmp_path):
    exact = tmp_path / "trainer.toml"
    exact.write_text("[run]\nexact = true\n\n[fp8]\nenabled = true\n")
    with pytest.raises(ConfigError, match=r"`fp8.enabled` with `run.exact` = true.*`fp8.enabled` from .*trainer.toml"):
        parse_args(TrainerConfig, ["@", str(exact)], environ={})
    lora = tmp_path / "sft.toml"
    lora.write_text("[data]\npath = \"x.jsonl\"\n\n[lora]\nenabled = true\n\n[fp8]\nenabled = true\nrecipe = \"rowwise\"\n")
    with pytest.raises(ConfigError, match=r"`fp8.enabled` with `lora.enabled`.*`fp8.enabled` from .*sft.toml"):
        parse_args(SFTConfig, ["@", str(lora)], environ={})


def test_latent_attention_is_refused_naming_the_key_and_the_file(tmp_path, dims):
    model = write_model(preset_config("tiny-glm5"), tmp_path / "glm5", weights=False)
    with pytest.raises(ValueError, match=r"`fp8.enabled` needs decoder blocks split at attention; .*config.json"):
        build_policy(ModelConfig(name=str(model), load_format="dummy"), ParallelConfig(), dims, chunk_size=4,
                     fp8=Float8TrainingConfig(enabled=True))


def test_a_trainer_on_a_cpu_is_refused_naming_the_key(tiny_model, tmp_path):
    config = TrainerConfig(model=ModelConfig(name=str(tiny_model)), device="cpu", output_dir=tmp_path, max_steps=1,
                           data=RolloutDataConfig(fake=True), fp8=Float8TrainingConfig(enabled=True))
    with pytest.raises(ValueError, match=r"`fp8.enabled` = true needs a CUDA GPU .* set `fp8.enabled` = false"):
        open_session(config, "trainer")
