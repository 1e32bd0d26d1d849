"""`benchmarks/inference.py`'s vLLM side: FP8 against vLLM is the like-for-like scheme (128 x 128 weight blocks, as a
released FP8 checkpoint says it), each variant's figures and ratios under its own suffix."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

from tandem.models.fp8 import quantize_weight
from tandem.models.presets import init_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # its own imports (provenance, roofline, ...)
# under a name of its own: `inference` is also tests/inference, a namespace package on the path
SPEC = importlib.util.spec_from_file_location("inference_benchmark", ROOT / "benchmarks" / "inference.py")
inference = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(inference)


def test_vllm_loads_fp8_as_a_released_block_fp8_checkpoint_says_it(tmp_path):
    """The folder vLLM loads for `fp8` carries the model's config and the `quantization_config` of a checkpoint in
    the engine's scheme: blocks of the shape `quantize_weight` makes."""
    folder = init_model("tiny", tmp_path / "model", seed=0, weights=False)
    assert inference.vllm_folder(folder, "none", tmp_path) == folder
    config = json.loads((inference.vllm_folder(folder, "fp8", tmp_path) / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == json.loads((folder / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["activation_scheme"] == "dynamic"
    _, scale_inv = quantize_weight(torch.randn(300, 260))
    assert [-(-300 // quant["weight_block_size"][0]), -(-260 // quant["weight_block_size"][1])] == list(scale_inv.shape)


def test_each_vllm_variant_is_compared_with_the_engine_variant_of_its_suffix():
    results = {"engine_A": {"output_tokens_per_s": 100.0}, "engine_A_w_fp8": {"output_tokens_per_s": 150.0},
               "vllm": {"vllm_A_logprobs": {"output_tokens_per_s": 80.0}},
               "vllm_w_fp8": {"vllm_A_logprobs": {"output_tokens_per_s": 100.0}}}
    inference.add_ratios(results, ["A"], ["", "_w_fp8"])
    assert results["ratio_engine_A_over_vllm_with_logprobs"] == 100 / 80
    assert results["ratio_engine_A_w_fp8_over_vllm_with_logprobs"] == 150 / 80
    assert results["ratio_engine_A_w_fp8_over_vllm_w_fp8_with_logprobs"] == 150 / 100
    assert results["ratio_engine_A_w_fp8_over_engine_A"] == 1.5
    summary = inference.summarize(results, ["A"], ["", "_w_fp8"])
    assert summary["vllm_w_fp8"]["vllm_A_logprobs"] == 100.0
