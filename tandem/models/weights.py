"""Read and write Hugging Face-named safetensors weights of a model folder.

Tensors are named as the models hold them in memory; experts are converted from and to their
on-disk layout here (`tandem.models.expert_layout`), the one door every reader and writer goes through.
Writers are atomic per file (tmp + rename) because another process (the inference server)
reads these folders while the trainer writes the next one.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.models.expert_layout import is_mtp_layer, to_disk, to_memory
from tandem.transport.paths import STABLE


WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth)$|.*\.safetensors\.index\.json$")
"""Files of a model folder that are weights, which a writer of a new folder writes itself instead of copying."""


def side_files(model_folder: Path) -> list[Path]:
    """The non-weight files of a model folder (config, generation config, tokenizer), copied as is by writers of
    new folders; dot files (a run folder's `STABLE` marker and tmp files) are not part of a model."""
    return sorted(p for p in Path(model_folder).iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.name != STABLE and not WEIGHT_FILE.match(p.name))


def unquantized_side_file(src: Path) -> bytes:
    """`src`'s bytes for a folder whose weights `save_state_dict` wrote unquantized: a `config.json` without its
    `quantization_config` (a released FP8 checkpoint's scheme), which would tell readers to look for block scales
    that the new folder does not hold; any other side file as it is."""
    if src.name != "config.json":
        return src.read_bytes()
    config = json.loads(src.read_text())
    if "quantization_config" not in config:
        return src.read_bytes()
    del config["quantization_config"]
    return (json.dumps(config, indent=2) + "\n").encode()


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder, in index order when sharded."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    return files


def load_state_dict(folder: Path, device: str | torch.device = "cpu", keep_mtp: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the folder under its in-memory HF name (the family read from its config.json); without
    `keep_mtp`, none of its multi-token prediction layers' (`expert_layout.is_mtp_layer`), which are never read."""
    folder = Path(folder)
    config = folder / "config.json"
    hf_config = json.loads(config.read_text()) if config.is_file() else {}
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt", device=str(device)) as tensors:
            state.update({name: tensors.get_tensor(name) for name in tensors.keys()
                          if keep_mtp or not is_mtp_layer(name, hf_config)})
    return to_memory(state, hf_config)


def save_state_dict(state: dict[str, torch.Tensor], folder: Path, hf_config: dict) -> Path:
    """Write in-memory named `state` as `model.safetensors` atomically, in the on-disk layout of
    `hf_config`'s family; a tied `lm_head.weight` is left out as HF does."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    state = to_disk({k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}, hf_config)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    target = folder / "model.safetensors"
    tmp = folder / ".model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, target)
    return target
