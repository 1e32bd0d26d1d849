"""Router statistics, the load-balancing loss and the aux-free bias update, against transformers'
Qwen3-MoE (router logits, `load_balancing_loss_func`) and an independent top-k count."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.fsdp import fully_shard

from tandem.config.trainer import RolloutDataConfig
from tandem.models.moe import MoE, MoEArgs
from tandem.trainer.data import fake_batch
from tandem.trainer.parallel.dims import close_parallel, init_parallel
from tandem.trainer.router import build_router_monitor
from tandem.transport.paths import weights_dir

from trainer_helpers import metrics, run_trainer


def reference_router_logits(folder, rows) -> list[list[torch.Tensor]]:
    """transformers' router logits [N, E] of each row, per layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = []
    for row in rows:
        ids = torch.tensor([row.input_ids])
        pos = torch.tensor([row.position_ids])
        out.append(list(model(input_ids=ids, position_ids=pos, output_router_logits=True).router_logits))
    return out, model


def test_router_statistics_and_balance_loss_match_transformers(tiny_moe_model, tmp_path):
    alpha, lr, seq_len = 0.05, 1.0, 32
    common = ["--model.name", str(tiny_moe_model), "--data.fake", "--data.fake-rows", "1", "--max-steps", "1",
              "--seq-len", str(seq_len), "--optim.type", "sgd", "--optim.lr", str(lr), "--optim.max-grad-norm", "0"]
    assert run_trainer(*common, "--output-dir", str(tmp_path / "off")) == 0
    assert run_trainer(*common, "--output-dir", str(tmp_path / "on"), "--router.aux-loss-coef", str(alpha)) == 0
    (off,), (on,) = metrics(tmp_path / "off"), metrics(tmp_path / "on")

    rows = fake_batch(1, 0, 1, RolloutDataConfig(fake=True, fake_rows=1), seq_len, 260, seed=0).rows
    (logits,), model = reference_router_logits(tiny_moe_model, rows)
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    counts = [torch.bincount(torch.topk(l.softmax(-1), k).indices.reshape(-1), minlength=E).tolist() for l in logits]
    assert off["router/tokens_per_expert"] == counts
    ratios = [max(c) / (sum(c) / E) for c in counts]
    assert off["router/max_over_mean"] == pytest.approx(ratios) and off["router/max_over_mean_worst"] == pytest.approx(max(ratios))
    entropy = [float(-(l.softmax(-1) * l.log_softmax(-1)).sum(-1).mean().detach()) for l in logits]
    assert off["router/entropy_per_layer"] == pytest.approx(entropy, abs=1e-5)
    assert "router/aux_loss" not in off

    # transformers' loss is E * sum_e (tokens_e / N) * P_e; ours divides f_e by k (1 when balanced).
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    aux = sum(load_balancing_loss_func((l,), E, k) / k for l in logits)
    assert on["router/aux_loss"] == pytest.approx(alpha * float(aux), rel=1e-5)
    assert on["loss"] == off["loss"]  # the balance loss is not part of the logged RL loss
    (alpha * aux).backward()
    w_off, w_on = (load_file(weights_dir(tmp_path / r, 1) / "model.safetensors") for r in ("off", "on"))
    for i, layer in enumerate(model.model.layers):
        name = f"model.layers.{i}.mlp.gate.weight"
        # SGD, no clipping: the two runs differ by -lr times the balance loss's gradient.
        torch.testing.assert_close(w_on[name] - w_off[name], -lr * layer.mlp.gate.weight.grad, atol=1e-6, rtol=1e-4)
        assert layer.mlp.gate.weight.grad.abs().max() > 1e-4


def test_bias_update_in_training_follows_the_logged_load(tiny_minimax_model, tmp_path):
    """One step with `router.bias_update_rate`: each block's bias moves by rate * sign(mean load - load)."""
    from tandem.models.weights import load_state_dict

    rate = 0.01
    assert run_trainer("--model.name", str(tiny_minimax_model), "--data.fake", "--data.fake-rows", "2", "--max-steps", "1",
                       "--seq-len", "32", "--router.bias-update-rate", str(rate), "--output-dir", str(tmp_path)) == 0
    (step,) = metrics(tmp_path)
    before, after = load_state_dict(tiny_minimax_model), load_state_dict(weights_dir(tmp_path, 1))
    names = sorted((k for k in before if k.endswith("e_score_correction_bias")), key=lambda k: int(k.split(".")[2]))
    assert len(names) == len(step["router/tokens_per_expert"]) == 2
    for name, load in zip(names, step["router/tokens_per_expert"]):
        load = torch.tensor(load, dtype=torch.float64)
        expected = before[name] + (rate * torch.sign(load.mean() - load)).to(before[name].dtype)
        torch.testing.assert_close(after[name], expected)
        assert not torch.equal(after[name], before[name])


class SparseBlock(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.mlp = MoE(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def test_aux_free_bias_update_follows_the_load_and_stays_out_of_the_optimizer():
    dims = init_parallel("cpu")
    try:
        torch.manual_seed(0)
        args = MoEArgs(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8, score_func="sigmoid", score_bias="router")
        blocks = nn.ModuleList([SparseBlock(args)])
        for p in blocks.parameters():
            nn.init.normal_(p, std=0.5) if p.requires_grad else nn.init.normal_(p, std=0.01)
        start = blocks[0].mlp.gate.e_score_correction_bias.detach().clone()
        fully_shard(blocks[0], mesh=dims.mesh)  # the bias becomes a DTensor shard, as in training
        monitor = build_router_monitor(blocks, 0.0, 1e-3, dims.device, "test")
        x = torch.randn(3, 10, 16)
        monitor.begin_step(1)
        with monitor.collecting():
            blocks[0](x)
        blocks[0].reshard()  # sharded again, as after backward in training
        step = monitor.end_step(update_bias=True)

        gate_weight = blocks[0].mlp.gate.weight.full_tensor()
        choice = torch.sigmoid(x.reshape(-1, 16) @ gate_weight.T) + start
        load = torch.bincount(torch.topk(choice, 2).indices.reshape(-1), minlength=8).double()
        assert step["router/tokens_per_expert"] == [load.long().tolist()]
        expected = start + 1e-3 * torch.sign(load.mean() - load).float()
        assert (load != load.mean()).all()  # every expert moves
        torch.testing.assert_close(blocks[0].mlp.gate.e_score_correction_bias.full_tensor(), expected)
        assert not blocks[0].mlp.gate.e_score_correction_bias.requires_grad
    finally:
        close_parallel()


def test_bias_update_needs_a_router_with_a_bias(tiny_moe_model, tmp_path):
    with pytest.raises(ValueError, match=r"`router.bias_update_rate` = 0.001 but the routers of test have no"):
        build_router_monitor(nn.ModuleList([SparseBlock(MoEArgs(num_experts=4, top_k=1, hidden_size=8, intermediate_size=4))]),
                             0.0, 1e-3, torch.device("cpu"), "test")


def test_active_parameters_count_k_of_e_routed_experts(tiny_moe_model):
    """MFU's P_active for tiny-moe: every parameter of transformers' model, less 6 of each block's 8 experts."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from tandem.models.loading import build_native
    from tandem.trainer.flops import active_params

    config = AutoConfig.from_pretrained(tiny_moe_model)
    with torch.device("meta"):
        total = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    H, I, E, k = config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok
    inactive = config.num_hidden_layers * (E - k) * 3 * H * I  # gate, up and down of each idle expert
    assert active_params(build_native(json.loads((tiny_moe_model / "config.json").read_text()))) == total - inactive
