"""A model folder rewritten as a released block-FP8 checkpoint lays it out: the weights whose on-disk names match a
pattern stored in float8_e4m3fn beside their 128 x 128 block scales (`<name>_scale_inv`), the rest as they were, and
`quantization_config` in config.json. Shared by the engine's and the trainer's tests of FP8 checkpoints."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from tandem.models.fp8 import quantize_weight
from tandem.models.weights import weight_files

CHECKPOINT_SCHEME = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

DECODER_RELEASE = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(shared_experts\.|experts\.\d+\.)?"
                             r"(gate|up|down)_proj)\.weight")
"""The on-disk names of the weights a released FP8 checkpoint of decoder blocks (Qwen3, GLM-4.5, a mixture of experts
per expert) holds in FP8."""

LATENT_RELEASE = re.compile(r"model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|"
                            r"indexer\.(wq_b|wk))|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj)\.weight")
"""The on-disk names of the weights GLM-5-FP8 and DeepSeek-V3 hold in FP8: MLA's projections (kv_b included), the DSA
indexer's wq_b and wk (not `weights_proj`), the dense, shared and routed experts' projections, in every block and
the multi-token prediction layer (`model.layers.{num_hidden_layers}`, whose `eh_proj` stays unquantized)."""


def write_fp8_release(source: Path, folder: Path, quantized: re.Pattern) -> Path:
    """`source`'s model as an FP8 release in `folder`: each on-disk weight `quantized` matches in FP8 blocks."""
    shutil.copytree(source, folder)
    for file in weight_files(folder):
        file.unlink()
    on_disk = load_file(str(weight_files(source)[0]))
    for name in [n for n in on_disk if quantized.fullmatch(n)]:
        on_disk[name], on_disk[name + "_scale_inv"] = quantize_weight(on_disk[name])
    save_file(on_disk, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, quantization_config=CHECKPOINT_SCHEME)))
    return folder
