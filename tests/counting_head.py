"""A tiny model whose choices are clear and varied, shared by the inference and trainer tests.

Greedy decoding of a random model is a poor test: its top tokens nearly tie (float rounding, which differs with
batch shapes, could flip them), its samples at a usual temperature are near uniform (drafts are then never
accepted), and it soon repeats one token. A "counting" LM head maps token t's embedding to token t + 1, and
halved embeddings let context (attention) still move about a third of the choices: varied outputs, top-2 logit
margins above 1e-3, a thousand times float32 rounding, and samples at T = 0.7 that are often the greedy choice.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tandem.models.weights import load_state_dict, save_state_dict


def give_counting_head(folder: Path) -> Path:
    """Untie the model's LM head and make it map token t's (halved) embedding to token t + 1, in place."""
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    state = load_state_dict(folder)
    embed = state["model.embed_tokens.weight"] * 0.5
    state["model.embed_tokens.weight"] = embed
    state["lm_head.weight"] = 10 * torch.roll(embed / embed.norm(dim=-1, keepdim=True), 1, 0)
    save_state_dict(state, folder, config)
    return folder


def give_counting_mtp_layer(folder: Path) -> Path:
    """Make a model's multi-token prediction layer (a latent one, or a draft head) pass token t + 1's embedding on
    to the LM head (its attention and feed-forward add nothing), in place: under a counting head it drafts t + 2,
    right wherever the policy counts."""
    state = load_state_dict(folder)
    layer = "model.mtp_layers.0."
    hidden_size = state[layer + "eh_proj.weight"].shape[0]
    state[layer + "eh_proj.weight"] = torch.cat([torch.eye(hidden_size), torch.zeros(hidden_size, hidden_size)], 1)
    for name in ("self_attn.o_proj.weight", "mlp.experts.down_proj", "mlp.shared_experts.down_proj.weight",
                 "mlp.down_proj.weight"):
        if layer + name in state:
            state[layer + name] = torch.zeros_like(state[layer + name])
    save_state_dict(state, folder, json.loads((folder / "config.json").read_text()))
    return folder
