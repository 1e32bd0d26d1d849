"""Helpers of the inference tests: server configs, teacher-forced logprobs, a counting LM head."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tandem.config.inference import InferenceConfig
from tandem.models.weights import load_state_dict, save_state_dict

ENGINE = {"device": "cpu", "num_blocks": 512, "block_size": 16, "max_model_len": 1024, "max_num_seqs": 64, "max_num_batched_tokens": 1024}
"""Engine settings of the test servers: CPU (fp32, exact parity), an 8k-token cache allocated in no time."""


def teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float,
                            device: str = "cpu") -> torch.Tensor:
    """log_softmax(logits / T) of each completion token, from one forward pass over the whole sequence (on the CPU)."""
    ids = torch.tensor([prompt + completion], device=device)
    with torch.no_grad():
        logits = model.lm_head(model(ids, torch.arange(ids.shape[1], device=device)[None])).float()[0].cpu()
    scaled = logits / (temperature if temperature > 0 else 1.0)
    rows = scaled[len(prompt) - 1:-1].log_softmax(-1)
    return rows.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def make_config(model_dir: Path, **engine) -> InferenceConfig:
    return InferenceConfig.model_validate({"model": {"name": str(model_dir)}, "engine": {**ENGINE, **engine}})


def give_counting_head(folder: Path) -> Path:
    """Untie the model's LM head and make it map token t's (halved) embedding to token t + 1 (see `sharp_dir`)."""
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    state = load_state_dict(folder)
    embed = state["model.embed_tokens.weight"] * 0.5
    state["model.embed_tokens.weight"] = embed
    state["lm_head.weight"] = 10 * torch.roll(embed / embed.norm(dim=-1, keepdim=True), 1, 0)
    save_state_dict(state, folder, config)
    return folder
