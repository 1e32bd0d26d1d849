"""Read and write Hugging Face-named safetensors weights of a model folder.

Writers are atomic per file (tmp + rename) because another process (the inference server)
reads these folders while the trainer writes the next one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


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


def load_state_dict(folder: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the folder, keyed by its HF name."""
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(Path(folder)):
        state.update(load_file(str(file), device=str(device)))
    return state


def save_state_dict(state: dict[str, torch.Tensor], folder: Path, tied_embeddings: bool = False) -> Path:
    """Write `model.safetensors` atomically; tied `lm_head.weight` is left out as HF does."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items() if not (tied_embeddings and k == "lm_head.weight")}
    target = folder / "model.safetensors"
    tmp = folder / ".model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, target)
    return target
