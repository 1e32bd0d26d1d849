"""The engine benchmark's memory roofline (`benchmarks/roofline.py`): what a decode step must read, and the
measured step's fraction of the time that takes."""

import sys
from pathlib import Path

import pytest
import torch

from tandem.inference.engine.kv_cache import KVCache
from tandem.models.loading import load_causal_lm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from roofline import decode_roofline, weight_bytes


def test_a_step_at_memory_speed_has_fraction_one_and_the_full_batch_median_is_used():
    weights, per_token, bandwidth = 1000, 10, 1e4
    steps = [(2, 100, (weights + 100 * per_token) / bandwidth),  # below the full batch: only in the totals
             (4, 300, 2 * (weights + 300 * per_token) / bandwidth),  # half memory speed
             (4, 500, (weights + 500 * per_token) / bandwidth)]  # memory speed
    figures = decode_roofline(steps, weights, per_token, {"nominal": bandwidth, "unknown": None})
    assert "unknown" not in figures and figures["full_batch"] == 4
    assert figures["full_batch_context_tokens_median"] == 400
    expected_median_s = (0.8 + 0.6) / 2
    assert figures["full_batch_step_median_s"] == pytest.approx(expected_median_s)
    assert figures["nominal"]["full_batch_fraction"] == pytest.approx((weights + 400 * per_token) / bandwidth / expected_median_s)
    total_bytes = 3 * weights + 900 * per_token
    assert figures["nominal"]["all_decode_fraction"] == pytest.approx(total_bytes / bandwidth / (0.2 + 0.8 + 0.6))


def test_bytes_read_per_step_count_tied_weights_once_and_every_layers_keys_and_values(tiny_dir):
    model = load_causal_lm(str(tiny_dir))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert weight_bytes(model) == 4 * sum(p.numel() for p in model.parameters())  # fp32, the tied matrix once
    cache = KVCache(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16,
                    device=torch.device("cpu"))
    assert cache.bytes_per_token == 2 * 2 * 2 * 32 * 2 == KVCache.bytes_per_block(2, 1, 2, 32, torch.bfloat16)
    fp8 = KVCache(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16,
                  device=torch.device("cpu"), fp8=True)
    assert fp8.bytes_per_token == 2 * 2 * 2 * (32 + 4)  # one byte an element, and each head's fp32 scale


def test_bytes_read_per_step_leave_out_the_prediction_layer(tmp_path):
    """GLM-5's multi-token prediction layer is loaded but no decode runs it; nor does a decode read the untied
    embedding matrix, only its tokens' rows."""
    from tandem.models.presets import init_model

    model = load_causal_lm(str(init_model("tiny-glm5", tmp_path / "m")))
    unread = [*model.model.mtp_layers.parameters(), model.model.embed_tokens.weight]
    assert weight_bytes(model) == 4 * (sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in unread))
