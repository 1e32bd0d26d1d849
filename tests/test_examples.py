"""Every example's configs resolve as `tandem rl --dry-run` resolves them: an example that no longer runs as
written fails here, in seconds, instead of at a user's first step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.config.loader import parse_args
from tandem.config.resolve import parse_rl_args
from tandem.config.sft import SFTConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("folder", sorted(p.name for p in EXAMPLES.iterdir() if (p / "rl.toml").is_file()))
def test_the_example_resolves(folder, monkeypatch):
    monkeypatch.chdir(EXAMPLES.parent)  # the examples name their files relative to the repository
    config = parse_rl_args(["@", f"examples/{folder}/rl.toml"], environ={})
    assert config.warmup.sft is not None and config.warmup.sft.is_file()
    sft = parse_args(SFTConfig, ["@", str(config.warmup.sft)], environ={})
    assert sft.output_dir.as_posix() in config.model.name  # RL starts from the model its warm-up writes
