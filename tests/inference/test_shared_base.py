"""`lora.share_base`: an engine whose weights are a trainer process's frozen base, mapped, serves the policy that an
engine with merged weights serves, across adapter updates, and holds no copy of the weights.

The trainer is a process of its own (`shared_base_trainer.py`: the trainer's `build_policy` with the base in shared
memory). Bound: a policy row over the shared base is `x W^T + s (x A^T) B^T`, the merged engine's `x (W + s B A)^T`;
both round at the merged weight's magnitude, so rows are held to `BOUND * (1 + |W_merged| / |W_base|)` as the base
rows beside merged weights are (`test_lora_base_serving.base_bound`). Before any update the adapters' B is zero and
the shared engine serves the base bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from inference_helpers import LORA, adapter_folder, run_engine

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.lora_side_path import EVERY_ROW, LowRankSidePath
from tandem.inference.engine.mapped_base import mapped_parameter_bytes
from tandem.inference.engine.setup import build_engine
from tandem.models.loading import load_causal_lm
from tandem.models.lora import LoraSpec, merged_state, read_adapter_folder
from tandem.models.presets import init_model
from tandem.models.stacked_projections import stack_projections
from tandem.models.weights import load_state_dict

BOUND = 1e-5
PROMPTS = [[5, 17, 99, 3, 42] * 8, [7, 8, 9, 200, 31, 64, 1], [11, 250, 4] * 7]
SPEC = LoraSpec(LORA["rank"], LORA["alpha"], tuple(LORA["target_modules"]))


@pytest.fixture(scope="module")
def shared_file(sharp_dir, tmp_path_factory):
    """The trainer's process, holding its base for the module's tests; the path of its `shared_base.json`."""
    run_dir = tmp_path_factory.mktemp("run")
    trainer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("shared_base_trainer.py")), str(sharp_dir),
                                str(run_dir), json.dumps(LORA), "cpu"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    path = Path(trainer.stdout.readline().strip())
    assert path.is_file(), f"the trainer's process exited with {trainer.poll()}"
    yield path
    trainer.stdin.close()
    assert trainer.wait(60) == 0


@pytest.fixture(scope="module")
def adapters(sharp_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    for seed in (1, 2):
        adapter_folder(sharp_dir, folder / f"a{seed}", seed=seed, std=0.1)
    return [read_adapter_folder(folder / f"a{seed}")[1] for seed in (1, 2)]


def engine_config(**lora) -> EngineConfig:
    return EngineConfig(device="cpu", num_blocks=64, max_model_len=256, lora={**LORA, **lora})


def shared_engine(folder, shared_file, base: str = "off"):
    return build_engine(ModelConfig(name=str(folder), dtype="float32"), engine_config(share_base=True), seed=0,
                        base=base, shared_base=shared_file)


def merged_engine(folder):
    return build_engine(ModelConfig(name=str(folder), dtype="float32"), engine_config(), seed=0)


def bound(folder, adapters: dict[str, torch.Tensor]) -> float:
    base = load_state_dict(folder)
    merged = merged_state(base, adapters, SPEC)
    ratios = [(merged[n].norm() / base[n].norm()).item() for n in merged if not torch.equal(merged[n], base[n])]
    return BOUND * (1 + max(ratios))


def test_the_policy_over_a_shared_base_is_the_merged_engines_across_updates(sharp_dir, shared_file, adapters):
    shared, merged = shared_engine(sharp_dir, shared_file), merged_engine(sharp_dir)
    requests = [(False, prompt) for prompt in PROMPTS]
    assert run_engine(shared, requests) == run_engine(merged, requests)  # policy 0: B = 0, the base itself
    for version, state in enumerate(adapters + adapters[:1], start=1):
        shared.update_weights(state, version)
        merged.update_weights(state, version)
        for got, want in zip(run_engine(shared, requests), run_engine(merged, requests)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=bound(sharp_dir, state), rtol=0)


def test_base_rows_beside_the_policy_take_no_side_path(sharp_dir, shared_file, adapters):
    """The base served by name over a shared base: its rows are the trainer's weights alone, bit for bit those of an
    engine before any update, while policy rows in the same steps get the adapters."""
    shared = shared_engine(sharp_dir, shared_file, base="required")
    plain = run_engine(shared, [(False, prompt) for prompt in PROMPTS])
    shared.update_weights(adapters[0], 1)
    mixed = run_engine(shared, [(True, PROMPTS[0]), (False, PROMPTS[1]), (True, PROMPTS[2])])
    assert mixed[0] == plain[0] and mixed[2] == plain[2]
    assert mixed[1] != plain[1]


def test_the_engine_holds_no_copy_of_the_weights(sharp_dir, shared_file):
    engine = shared_engine(sharp_dir, shared_file)
    model = engine.runner.model
    run_engine(engine, [(False, PROMPTS[0])])
    inside, outside = mapped_parameter_bytes(model, model.mapped_base)
    assert outside == 0 and inside == sum(p.numel() * p.element_size() for p in model.parameters())
    # the pages this process reads are the trainer's: resident, and shared with its process, none private
    mapping = mapping_stats(json.loads(shared_file.read_text())["buffer"]["path"])
    assert mapping["Rss"] > 0 and mapping["Private_Clean"] == mapping["Private_Dirty"] == 0
    # the fused blocks' stacks are views of the shared buffer: q/k/v and gate/up were laid end to end
    stacked = stack_projections(model.layers[0])
    buffer = model.mapped_base.buffer
    for stack in (stacked.qkv, stacked.gate_up):
        assert buffer.data_ptr() <= stack.data_ptr() < buffer.data_ptr() + buffer.numel()


def mapping_stats(path: str) -> dict[str, int]:
    """The kB counts of /proc/self/smaps for every mapping of `path`, summed."""
    totals: dict[str, int] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            inside = fields[-1] == path
        elif inside and fields[0].endswith(":") and len(fields) == 3 and fields[2] == "kB":
            totals[fields[0][:-1]] = totals.get(fields[0][:-1], 0) + int(fields[1])
    return totals


def test_full_weights_and_misfit_adapters_change_nothing(sharp_dir, shared_file, adapters):
    shared = shared_engine(sharp_dir, shared_file)
    before = run_engine(shared, [(False, PROMPTS[1])])
    with pytest.raises(KeyError, match="adapters only, not full weights"):
        shared.update_weights(load_state_dict(sharp_dir))
    wide = {name: torch.zeros(8, t.shape[1]) if name.endswith("lora_A.weight") else t for name, t in adapters[0].items()}
    with pytest.raises(ValueError, match="rank 4 needs"):
        shared.update_weights(wide)
    assert run_engine(shared, [(False, PROMPTS[1])]) == before


def test_a_missing_shared_base_names_the_key(sharp_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"`engine.lora.share_base` maps the trainer's base"):
        shared_engine(sharp_dir, tmp_path / "shared_base.json")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_an_engine_over_the_trainers_device_memory(tmp_path):
    """On CUDA the trainer's bf16 base is mapped through CUDA IPC; the engine runs its fused blocks (reading the
    shared q/k/v and gate/up stacks) and CUDA graphs with the side path captured. Policy 0 is the merged engine's
    (zero adapters add zero); with adapters the two round differently in bf16 (the first token held to 0.02 in
    logprob, the mismatch a bf16 engine has against the trainer; later ones may sample apart), and decode steps
    replayed from graphs are the eager steps'. The engine's own allocations hold no weights."""
    folder = init_model("qwen3-0.6b", tmp_path / "model", num_layers=4)
    run_dir = tmp_path / "run"
    trainer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("shared_base_trainer.py")), str(folder),
                                str(run_dir), json.dumps(LORA), "cuda"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        path = Path(trainer.stdout.readline().strip())
        assert path.is_file(), f"the trainer's process exited with {trainer.poll()}"
        config = dict(device="cuda", num_blocks=64, max_model_len=256, max_num_seqs=8)
        before = torch.cuda.memory_allocated()
        shared = build_engine(ModelConfig(name=str(folder)), EngineConfig(**config, lora={**LORA, "share_base": True}),
                              seed=0, shared_base=path)
        model = shared.runner.model
        inside, outside = mapped_parameter_bytes(model, model.mapped_base)
        assert outside == 0 and shared.runner.graphs is not None
        own = torch.cuda.memory_allocated() - before
        assert own < inside / 4, f"the engine allocated {own / 2**20:.0f} MiB beside {inside / 2**20:.0f} MiB of mapped weights"
        eager = build_engine(ModelConfig(name=str(folder)), EngineConfig(**config, cuda_graphs=False,
                                                                         lora={**LORA, "share_base": True}),
                             seed=0, shared_base=path)
        merged = build_engine(ModelConfig(name=str(folder)), EngineConfig(**config, lora=LORA), seed=0)
        requests = [(False, prompt) for prompt in PROMPTS] + [(False, [p[0]]) for p in PROMPTS]  # the last: decode
        for got, want in zip(run_engine(shared, requests), run_engine(merged, requests)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-3, rtol=0)
        state = random_adapters(model, seed=3)
        for engine in (shared, eager, merged):
            engine.update_weights(state, 1)
        graphed = run_engine(shared, requests)
        # the first token (a prefill step) against merged weights; every token, decode steps replayed, against eager
        for got, want in zip(graphed, run_engine(merged, requests)):
            torch.testing.assert_close(torch.tensor(got[:1]), torch.tensor(want[:1]), atol=0.02, rtol=0)
        for got, want in zip(graphed, run_engine(eager, requests)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-3, rtol=0)
    finally:
        trainer.stdin.close()
        trainer.wait(60)


def random_adapters(model, seed: int) -> dict[str, torch.Tensor]:
    """Adapters of rank `LORA`'s for every targeted projection of `model`, A and B random (a policy not the base)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LORA["target_modules"]:
            state[f"{name}.lora_A.weight"] = torch.randn(LORA["rank"], module.in_features, generator=gen) * 0.02
            state[f"{name}.lora_B.weight"] = torch.randn(module.out_features, LORA["rank"], generator=gen) * 0.02
    return state


@pytest.mark.parametrize("rows", [EVERY_ROW, torch.tensor([1, 4])])
def test_stacked_adapters_add_what_each_projection_adds(tiny_dir, rows):
    """`LowRankSidePath.stack` (the fused blocks' q/k/v as one A and one block-diagonal B) adds what the side path
    adds part by part, on every row or on chosen rows, after `load` filled the stacks through each part's view."""
    model = load_causal_lm(str(tiny_dir), "cpu", "float32")
    attention = model.layers[0].self_attn
    parts = [attention.q_proj, attention.k_proj, attention.v_proj]
    gen = torch.Generator().manual_seed(0)
    pairs = {f"p{i}.weight": (torch.randn(4, linear.in_features, generator=gen),
                              torch.randn(linear.out_features, 4, generator=gen)) for i, linear in enumerate(parts)}
    x = torch.randn(6, attention.q_proj.in_features, generator=gen)
    plain = torch.cat([F.linear(x, linear.weight) for linear in parts], dim=-1)
    outputs = []
    for stacked in (False, True):
        side = LowRankSidePath({f"p{i}": linear for i, linear in enumerate(parts)}, 2.0, 1.0, 4, torch.device("cpu"),
                               torch.float32)
        if stacked:
            side.stack(parts)
        side.load(pairs)
        side.rows = rows
        y = plain.clone()
        side.add_to_parts(parts, x, y)
        outputs.append(y)
    # fp32, sums of the same terms in other groupings: a few units in the last place of the largest output
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-6 * outputs[0].abs().max().item(), rtol=0)
    changed = torch.zeros(6, dtype=torch.bool)
    changed[rows] = True
    assert torch.equal(outputs[1][~changed], plain[~changed]) and not torch.allclose(outputs[1][changed], plain[changed])
