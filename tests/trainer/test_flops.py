"""MFU's numerator for each attention the trainer runs: heads of one size, multi-head latent attention in its expanded
form, and DeepSeek sparse attention with its forward-only indexers (`tandem.trainer.flops`)."""

import torch

from tandem.models import glm_moe_dsa
from tandem.models.loading import load_causal_lm
from tandem.models.presets import PRESETS, shape_config, write_model
from tandem.trainer.flops import (active_params, attended_pairs, attention_flops, inactive_expert_params, indexer_flops,
                                  indexer_params)

LENGTHS = [40, 7, 100]


def test_heads_of_one_size_keep_the_usual_count():
    config = shape_config(PRESETS["tiny"])
    L, H, D = config["num_hidden_layers"], config["num_attention_heads"], config["head_dim"]
    assert attention_flops(config, LENGTHS) == 6 * L * H * D * sum(n * n for n in LENGTHS)


def test_latent_attention_counts_its_query_key_and_value_dims():
    """DeepSeek-V3 (no DSA): QK^T over Dn + Dr, PV over Dv, not the config's `head_dim` (which transformers sets to
    Dr)."""
    config = shape_config(PRESETS["tiny-deepseek-v3"])
    qk, v = config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["v_head_dim"]
    assert config["head_dim"] not in (qk, v)
    expected = 3 * config["num_hidden_layers"] * config["num_attention_heads"] * (qk + v) * sum(n * n for n in LENGTHS)
    assert attention_flops(config, LENGTHS) == expected
    assert indexer_flops(config, LENGTHS) == 0


def test_sparse_attention_counts_the_pairs_the_indexer_keeps(tmp_path, monkeypatch):
    """tiny-glm5 keeping 16 tokens: the pairs its selections keep in a forward over a packed row of documents below
    and past 16 tokens, as counted by the model itself, are the count's within half a document's length (the count
    takes L^2 / 2 for a causal sequence's pairs, the model L (L + 1) / 2)."""
    topk = 16
    config = shape_config(dict(PRESETS["tiny-glm5"], index_topk=topk))
    model = load_causal_lm(str(write_model(config, tmp_path / "m")))
    kept = []
    choose = glm_moe_dsa.chosen

    def counting(*args):
        selection = choose(*args)
        kept.append(int(selection.counts.sum()))
        return selection

    monkeypatch.setattr(glm_moe_dsa, "chosen", counting)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        model(torch.randint(0, 256, positions.shape), positions)
    full = config["indexer_types"].count("full")
    assert len(kept) == full and full >= 1
    for count in kept:
        assert abs(count - sum(attended_pairs(n, topk) for n in LENGTHS)) <= sum(LENGTHS) / 2
    assert sum(attended_pairs(n, topk) for n in LENGTHS) < sum(attended_pairs(n, None) for n in LENGTHS)
    heads = config["num_attention_heads"]
    qk, v = config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["v_head_dim"]
    sparse = 6 * config["num_hidden_layers"] * heads * (qk + v) * sum(attended_pairs(n, topk) for n in LENGTHS)
    assert attention_flops(config, LENGTHS) == sparse + indexer_flops(config, LENGTHS)


def test_the_indexers_run_forward_only_and_leave_active_parameters(tmp_path):
    """The indexers' parameters, counted from the model's modules, are those `indexer_flops` counts from the config
    (2 FLOPs each per token), and `active_params` (6 FLOPs each) leaves them out."""
    config = shape_config(PRESETS["tiny-glm5"])
    model = load_causal_lm(str(write_model(config, tmp_path / "m")))
    full = config["indexer_types"].count("full")
    in_model = indexer_params(model.layers, matrices_only=True)  # the trunk's (the MTP layer has one too)
    assert in_model > 0
    tokens = [30]
    scores = full * 2 * config["index_n_heads"] * config["index_head_dim"] * attended_pairs(30, None)
    assert indexer_flops(config, tokens) - scores == 2 * in_model * 30
    outside = sum(p.numel() for name, p in model.named_parameters() if ".indexer." not in name)
    assert outside < sum(p.numel() for p in model.parameters())
    assert active_params(model) == outside - inactive_expert_params(model.layers)
