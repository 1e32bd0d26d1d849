"""Find a model folder (a local path, or a hub name fetched once into the HF cache) and read its config."""

from __future__ import annotations

import json
from pathlib import Path


def resolve_model_path(name: str) -> Path:
    """A folder holding `config.json`; hub names need network access the first time."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        return path
    if not is_hub_name(name):
        raise FileNotFoundError(f"model {name!r} is neither a model folder nor a hub name (org/model)")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))


def config_folder(name: str) -> Path:
    """A folder holding the model's `config.json`: the model folder, or for a hub name its HF cache snapshot with
    `config.json` alone fetched, for a process that reads the config and leaves the weights to another program."""
    path = Path(name).expanduser()
    if path.is_dir() or not is_hub_name(name):
        return resolve_model_path(name)
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(name, "config.json")).parent


def is_hub_name(name: str) -> bool:
    """Whether `name` reads as a hub name (`org/model`): no existing path, nothing that starts a path
    (`.`, `/`, `~`), exactly one `/`."""
    return not Path(name).expanduser().exists() and not name.startswith((".", "/", "~")) and name.count("/") == 1


def read_hf_config(folder: Path) -> dict:
    """The folder's `config.json` as a dict."""
    return json.loads((Path(folder) / "config.json").read_text())
