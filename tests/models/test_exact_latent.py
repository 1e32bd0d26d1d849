"""Exact mode's latent attention blocks (`tandem.models.exact_latent`): the same model as the default forward (within
fp32 rounding), and DSA's per-token choice with its tie rule. Engine against trainer, bitwise:
tests/trainer/test_exact_parity.py."""

from __future__ import annotations

import pytest
import torch
from test_moe import DOCUMENTS, packed_row

from tandem.models.exact import ExactDocumentAttention, apply_exact
from tandem.models.exact_latent import choose_token
from tandem.models.loading import load_causal_lm
from tandem.models.presets import PRESETS, shape_config, write_model


@pytest.mark.parametrize("shape", [
    # A full and a shared DSA layer choosing 4 tokens, for most tokens of the row's 11-, 7- and 14-token documents.
    dict(PRESETS["tiny-glm5"], num_hidden_layers=2, index_topk=4),
    dict(PRESETS["tiny-deepseek-v3"], num_hidden_layers=2),
], ids=["glm5", "deepseek-v3"])
def test_the_exact_forward_computes_the_default_forwards_model(shape, tmp_path):
    """A row packing three documents: the absorbed form token by token, each token choosing over its own context,
    gives the expanded form's hidden states over the whole row, and gradients flow to the attention's weights."""
    folder = write_model(shape_config(shape), tmp_path / "m")
    default, exact = load_causal_lm(str(folder)), load_causal_lm(str(folder))
    apply_exact(exact)
    ids, positions = packed_row(default.args.vocab_size)
    with torch.no_grad():
        expected = default(ids, positions)
    got = exact(ids, positions, attention=ExactDocumentAttention([DOCUMENTS]))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    got.square().sum().backward()
    attention = exact.layers[-1].self_attn
    assert attention.kv_b_proj.weight.grad.abs().sum() > 0 and attention.q_b_proj.weight.grad.abs().sum() > 0


def test_dsa_keeps_the_top_k_ties_to_the_earlier_position_in_ascending_order():
    heads, dim = 2, 4
    queries, weights = torch.ones(heads, dim), torch.ones(heads)
    keys = torch.zeros(10, dim)
    keys[7] = keys[3] = 1.0  # the two best, tied
    keys[[1, 5, 8]] = 0.5  # three tied next
    assert choose_token(queries, weights, keys, 4).tolist() == [1, 3, 5, 7]
    assert choose_token(queries, weights, keys, 1).tolist() == [3]
    assert choose_token(queries, weights, keys[:4], 4) is None  # a context of k tokens: all of them
