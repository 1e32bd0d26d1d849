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


def test_the_glm5_flagship_overlay_serves_its_warm_up_the_flagship_way(monkeypatch):
    """`reverse_text_glm5/flagship.toml` on `rl.toml`: the same warm-up's model, a run folder of its own, and the
    engine, servers and trainer of GLM-5's flagship deployment (tests/launch/test_rl_flagship.py runs it)."""
    monkeypatch.chdir(EXAMPLES.parent)
    base = parse_rl_args(["@", "examples/reverse_text_glm5/rl.toml"], environ={})
    flagship = parse_rl_args(["@", "examples/reverse_text_glm5/rl.toml", "@", "examples/reverse_text_glm5/flagship.toml"],
                             environ={})
    assert flagship.model.name == base.model.name and flagship.warmup == base.warmup
    assert flagship.output_dir != base.output_dir
    engine = flagship.inference.engine
    assert (engine.quantization, engine.kv_cache_dtype, engine.speculative.method) == ("fp8", "fp8", "mtp")
    assert flagship.deployment.is_disaggregated and flagship.trainer.mtp.train


class OneGpu:
    """A machine with one CUDA device, for the examples written for one GPU."""

    def num_cuda_devices(self) -> int:
        return 1

    def free_port(self) -> int:
        return 43210


ONE_GPU_EXAMPLES = [[str(p.relative_to(EXAMPLES.parent))] for p in sorted(EXAMPLES.glob("*/*_gpu.toml"))] + [
    ["examples/reverse_text/rl_lora_gpu.toml", "examples/reverse_text/lora_shared_base.toml"]]
"""Each `*_gpu.toml`, and the overlays its README layers on it."""


@pytest.mark.parametrize("configs", ONE_GPU_EXAMPLES, ids=lambda configs: "+".join(Path(c).stem for c in configs))
def test_the_one_gpu_examples_resolve_on_one_gpu(configs, monkeypatch):
    monkeypatch.chdir(EXAMPLES.parent)
    resolved = parse_rl_args([arg for config in configs for arg in ("@", config)], environ={}, machine=OneGpu())
    assert resolved.deployment.trainer_devices == resolved.deployment.inference_devices == [0]
    if resolved.trainer.lora.enabled:
        assert resolved.inference.engine.lora == resolved.trainer.lora


@pytest.mark.parametrize("folder", sorted(p.name for p in EXAMPLES.iterdir() if (p / "rl.toml").is_file()))
def test_the_example_warmup_data_can_be_written(folder, monkeypatch, tmp_path):
    """The `[warmup]` counts fit the environment (a wiki of 1,580 questions cannot give 2,100
    demonstrations): the data step runs as `tandem rl` runs it. code_fix's and swe's demonstrations run the
    tests in the sandbox twice each (minutes for 1,100), so there only the tasks are drawn (swe's instances
    still checked at their base commits)."""
    import tandem.envs.code_fix as code_fix
    import tandem.envs.swe as swe
    from tandem.launch.warmup import write_sft_data

    async def no_demonstration(row, *_):
        return [{"role": "user", "content": row["question"]}]

    async def no_swe_demonstration(store, prepared, limits, pytest_python):
        return [{"role": "user", "content": prepared.instance.problem_statement}]

    monkeypatch.setattr(code_fix, "_demonstration", no_demonstration)
    monkeypatch.setattr(swe, "_demonstration", no_swe_demonstration)
    monkeypatch.chdir(EXAMPLES.parent)
    warmup = parse_rl_args(["@", f"examples/{folder}/rl.toml"], environ={}).warmup
    path = tmp_path / "train.jsonl"
    write_sft_data(warmup.data_env, path, warmup.num_examples, warmup.num_eval_examples, warmup.data_args)
    assert len(path.read_text().splitlines()) == warmup.num_examples
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == warmup.num_eval_examples


@pytest.mark.parametrize("folder", sorted(p.name for p in EXAMPLES.iterdir() if (p / "eval.toml").is_file()))
def test_the_eval_example_resolves_and_its_environments_load(folder, monkeypatch):
    from tandem.config.eval import EvalConfig
    from tandem.orchestrator.environments import load_envs

    monkeypatch.chdir(EXAMPLES.parent)
    config = parse_args(EvalConfig, ["@", f"examples/{folder}/eval.toml"], environ={})
    assert all(env.env.get_eval_dataset() for env in load_envs(config.envs))
