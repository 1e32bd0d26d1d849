"""The base model served by name beside a LoRA policy on tandem's engine: the adapters subtracted from base rows only.

Bound: a base row is `x W_merged^T - s (x A^T) B^T`, against the base model's `x W_base^T`. Any row the engine
computes is held to 1e-5 of the teacher-forced model in fp32 (`BOUND`, as the tests of `test_engine.py`); a base row
adds the roundings of the merged weight and of the subtracted product, which are at the merged weight's magnitude:
`|W_merged| / |W_base|` times the base's own (`base_bound`: BOUND * (1 + that ratio), the largest over the adapted
weights; the merged policy's forward rounds at the same magnitude, so its rows are held to it as well). Policy rows
never see the side path: bitwise equal beside base rows in a dense model.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from inference_helpers import LORA, adapter_folder, make_config, run_engine, teacher_forced_logprobs
from pydantic import ValidationError

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig, InferenceConfig
from tandem.inference.engine.fused_blocks import fused_block_forward
from tandem.inference.engine.llm_engine import BASE_WEIGHT_VERSION
from tandem.inference.engine.lora_side_path import LowRankSidePath
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.inference.server import BackgroundServer
from tandem.models.loading import load_causal_lm
from tandem.models.lora import export_merged, merged_state, read_adapter_folder
from tandem.models.presets import init_model
from tandem.models.weights import load_state_dict

BOUND = 1e-5
ADAPTER_STD = 0.1
"""Random adapters whose product is larger than the base weights it is added to: a policy far from the base."""
PROMPTS = [[5, 17, 99, 3, 42] * 8, [7, 8, 9, 200, 31, 64, 1], [11, 250, 4] * 7]
"""Prompts of 40, 7 and 21 tokens: the long ones fill prefix-cache blocks of 16."""


@pytest.fixture(scope="module")
def adapters(sharp_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters") / "a1"
    adapter_folder(sharp_dir, folder, seed=1, std=ADAPTER_STD)
    return folder


@pytest.fixture(scope="module")
def lora_server(sharp_dir, adapters):
    """The policy: the sharp model (clear greedy choices, see `sharp_dir`) and the adapters; its base beside it."""
    running = BackgroundServer(make_config(sharp_dir, lora=LORA))
    response = httpx.post(f"{running.url}/update_weights", json={"path": str(adapters)}, timeout=60)
    assert response.status_code == 200, response.text
    yield running
    running.stop()


@pytest.fixture(scope="module")
def base_server(sharp_dir):
    """The base model served alone, as any model."""
    running = BackgroundServer(make_config(sharp_dir))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def merged(adapters, tmp_path_factory):
    return load_causal_lm(str(export_merged(adapters, tmp_path_factory.mktemp("merged") / "m")), "cpu", "float32")


def base_bound(model_folder, adapters) -> float:
    """`BOUND` times 1 + the largest |W_merged| / |W_base| (Frobenius norms) of the adapted weights (module docstring)."""
    spec, state = read_adapter_folder(adapters)
    base = load_state_dict(model_folder)
    merged = merged_state(base, state, spec)
    ratios = [(merged[name].norm() / base[name].norm()).item() for name in merged
              if name.endswith("_proj.weight") and not torch.equal(merged[name], base[name])]
    return BOUND * (1 + max(ratios))


def base_name(folder) -> str:
    return f"{folder}-base"


async def generate_all(url: str, requests: list[tuple[str, list[int]]]) -> list[dict]:
    """`/v1/generate` for every (model, prompt) at once: in flight together, so the engine batches them."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(model: str, prompt: list[int]) -> dict:
            body = {"model": model, "prompt_token_ids": prompt, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
            response = await client.post(f"{url}/v1/generate", json=body)
            assert response.status_code == 200, response.text
            return response.json()
        return await asyncio.gather(*(one(model, prompt) for model, prompt in requests))


def test_base_and_policy_requests_in_one_batch_get_each_model(lora_server, base_server, sharp_dir, adapters, merged):
    policy, base = str(sharp_dir), base_name(sharp_dir)
    bound = base_bound(sharp_dir, adapters)
    base_model = load_causal_lm(str(sharp_dir), "cpu", "float32")
    mixed = [(policy, PROMPTS[0]), (base, PROMPTS[1]), (policy, PROMPTS[2]), (base, PROMPTS[0])]
    answers = asyncio.run(generate_all(lora_server.url, mixed))
    plain = asyncio.run(generate_all(base_server.url, [(policy, prompt) for _, prompt in mixed]))
    for (model, prompt), answer, base_answer in zip(mixed, answers, plain):
        choice = answer["choices"][0]
        logprobs = torch.tensor(choice["logprobs"])
        if model == base:
            # the base server's own greedy tokens and logprobs; its logprobs of them are the base model's
            assert choice["token_ids"] == base_answer["choices"][0]["token_ids"]
            torch.testing.assert_close(logprobs, torch.tensor(base_answer["choices"][0]["logprobs"]), atol=bound, rtol=0)
            torch.testing.assert_close(logprobs, teacher_forced_logprobs(base_model, prompt, choice["token_ids"], 1.0),
                                       atol=bound, rtol=0)
            assert answer["weight_version"] == choice["weight_version"] == BASE_WEIGHT_VERSION
        else:
            torch.testing.assert_close(logprobs, teacher_forced_logprobs(merged, prompt, choice["token_ids"], 1.0),
                                       atol=bound, rtol=0)
            assert answer["weight_version"] == choice["weight_version"] == 1
    # the adapters move the policy far from the base: a base answer is not the policy's by accident
    policy_of_base_prompt = teacher_forced_logprobs(merged, PROMPTS[1], answers[1]["choices"][0]["token_ids"], 1.0)
    assert not torch.allclose(torch.tensor(answers[1]["choices"][0]["logprobs"]), policy_of_base_prompt, atol=1e-2)


def test_a_prompt_the_policy_cached_is_computed_again_for_the_base(lora_server, base_server, sharp_dir, adapters):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 6  # three full blocks the prefix cache would share
    policy, base = str(sharp_dir), base_name(sharp_dir)
    first = asyncio.run(generate_all(lora_server.url, [(policy, prompt)]))[0]["choices"][0]
    then_base = asyncio.run(generate_all(lora_server.url, [(base, prompt)]))[0]["choices"][0]
    then_policy = asyncio.run(generate_all(lora_server.url, [(policy, prompt)]))[0]["choices"][0]
    reference = asyncio.run(generate_all(base_server.url, [(policy, prompt)]))[0]["choices"][0]
    assert then_base["token_ids"] == reference["token_ids"]
    torch.testing.assert_close(torch.tensor(then_base["logprobs"]), torch.tensor(reference["logprobs"]),
                               atol=base_bound(sharp_dir, adapters), rtol=0)
    assert then_policy == first  # and the base's blocks did not serve the policy either


def test_the_openai_client_routes_by_model_name(lora_server, base_server, sharp_dir, adapters):
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [str(sharp_dir), base_name(sharp_dir)]
    reference = openai.OpenAI(base_url=f"{base_server.url}/v1", api_key="unused").completions.create(
        model=str(sharp_dir), prompt=PROMPTS[2], max_tokens=6, temperature=0.0, logprobs=0)
    answers = {}
    for model in (str(sharp_dir), base_name(sharp_dir)):
        answers[model] = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=6, temperature=0.0,
                                                   logprobs=0)
        assert answers[model].model == model
    base = answers[base_name(sharp_dir)].choices[0]
    assert base.logprobs.tokens == reference.choices[0].logprobs.tokens
    torch.testing.assert_close(torch.tensor(base.logprobs.token_logprobs),
                               torch.tensor(reference.choices[0].logprobs.token_logprobs),
                               atol=base_bound(sharp_dir, adapters), rtol=0)
    assert answers[str(sharp_dir)].choices[0].logprobs.token_logprobs != reference.choices[0].logprobs.token_logprobs
    chat = client.chat.completions.create(model=base_name(sharp_dir), messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0.0)
    assert chat.model == base_name(sharp_dir) and chat.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=base_name(sharp_dir), prompt=PROMPTS[2], max_tokens=6, temperature=0.0,
                                            stream=True))
    assert {chunk.model for chunk in chunks} == {base_name(sharp_dir)}
    assert "".join(chunk.choices[0].text for chunk in chunks) == reference.choices[0].text
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt=[1, 2], max_tokens=2)
    assert err.value.body["param"] == "model"
    assert f"serves `{sharp_dir}` and `{base_name(sharp_dir)}`" in err.value.body["message"]


def test_an_unknown_model_name_is_a_404_json_error(lora_server):
    response = httpx.post(f"{lora_server.url}/v1/generate", json={"model": "other", "prompt_token_ids": [1], "max_tokens": 1})
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model" and "The model `other` does not exist" in response.json()["error"]["message"]


def lora_engine(folder, base: str = "required"):
    return build_engine(ModelConfig(name=str(folder), dtype="float32"),
                        EngineConfig(device="cpu", num_blocks=64, max_model_len=256, lora=LORA), seed=0, base=base)


@pytest.mark.parametrize("preset", ["tiny", "tiny-glm4-moe"])
def test_policy_rows_beside_base_rows_are_unchanged(preset, tmp_path):
    """The same batch shapes, one request the base's or the policy's: the other requests' logprobs are equal bit for
    bit in a dense model. GLM-4.5 holds a dense block and MoE blocks with shared experts (the side path's `MLP`
    there); a mixture of experts multiplies each expert's tokens together, so a neighbour's content (the base's
    tokens route elsewhere than the policy's) moves a row's roundings whatever the side path does: held to BOUND."""
    folder = init_model(preset, tmp_path / "model", seed=0)
    adapter_folder(folder, tmp_path / "a", seed=2, std=ADAPTER_STD)
    runs = []
    for base_second in (True, False):  # each run on an engine of its own: the first would leave its prompts cached
        engine = lora_engine(folder)
        engine.update_weights(read_adapter_folder(tmp_path / "a")[1])
        runs.append(run_engine(engine, [(False, PROMPTS[0]), (base_second, PROMPTS[2]), (False, PROMPTS[1])]))
    with_base, without = runs
    for i in (0, 2):
        if preset == "tiny":
            assert with_base[i] == without[i]
        else:
            torch.testing.assert_close(torch.tensor(with_base[i]), torch.tensor(without[i]), atol=BOUND, rtol=0)
    reference = run_engine(build_engine(ModelConfig(name=str(folder), dtype="float32"),
                                        EngineConfig(device="cpu", num_blocks=64, max_model_len=256), seed=0),
                           [(False, PROMPTS[2])])[0]
    torch.testing.assert_close(torch.tensor(with_base[1]), torch.tensor(reference), atol=base_bound(folder, tmp_path / "a"),
                               rtol=0)


def test_a_model_the_side_path_does_not_reach_is_refused_when_named(tmp_path):
    folder = init_model("tiny-glm5", tmp_path / "glm5", seed=0)
    with pytest.raises(ValueError, match=r"`server.base_model_name` is set, but the side path that serves the base model "
                                         r"does not reach the adapted projections"):
        build_engine(ModelConfig(name=str(folder), dtype="float32"),
                     EngineConfig(device="cpu", num_blocks=64, max_model_len=256,
                                  lora={**LORA, "target_modules": ["q_b_proj", "o_proj"]}), seed=0, base="required")
    unnamed = build_engine(ModelConfig(name=str(folder), dtype="float32"),
                           EngineConfig(device="cpu", num_blocks=64, max_model_len=256,
                                        lora={**LORA, "target_modules": ["q_b_proj", "o_proj"]}), seed=0,
                           base="where_possible")
    assert unnamed.base_path is None


def test_stacked_projections_are_corrected_part_by_part(tiny_dir):
    """The fused blocks' way (q/k/v in one matmul, `add_to_parts`) adds what each projection's own `linear` adds."""
    model = load_causal_lm(str(tiny_dir), "cpu", "float32")
    attention = model.layers[0].self_attn
    parts = [attention.q_proj, attention.k_proj, attention.v_proj]
    side = LowRankSidePath({f"p{i}": linear for i, linear in enumerate(parts)}, 2.0, -1.0, 4, torch.device("cpu"),
                           torch.float32)
    gen = torch.Generator().manual_seed(0)
    side.load({f"p{i}.weight": (torch.randn(4, linear.in_features, generator=gen),
                                torch.randn(linear.out_features, 4, generator=gen)) for i, linear in enumerate(parts)})
    x = torch.randn(6, attention.q_proj.in_features, generator=gen)
    side.rows = torch.tensor([1, 4])
    stacked = torch.cat([F.linear(x, linear.weight) for linear in parts], dim=-1)
    side.add_to_parts(parts, x, stacked)
    each = torch.cat([side.linear(x, linear.weight) for linear in parts], dim=-1)
    assert torch.equal(stacked, each)
    plain = torch.cat([F.linear(x, linear.weight) for linear in parts], dim=-1)
    assert torch.equal(stacked[[0, 2, 3, 5]], plain[[0, 2, 3, 5]]) and not torch.allclose(stacked[[1, 4]], plain[[1, 4]])


@pytest.mark.parametrize("values, serving", [
    ({"engine": {"lora": LORA}}, "where_possible"),
    ({"engine": {"lora": LORA}, "server": {"base_model_name": "start"}}, "required"),
    ({"engine": {"lora": LORA}, "run": {"exact": True}}, "off"),
    ({"engine": {"lora": LORA, "speculative": {"method": "ngram"}}}, "off"),
    ({"engine": {"lora": {**LORA, "target_experts": ["down_proj"]}}}, "off"),  # grouped matmuls take no side path
    ({}, "off"),
])
def test_the_config_says_whether_the_base_is_served(values, serving):
    assert InferenceConfig.model_validate({"model": {"name": "m"}, **values}).base_serving == serving


def test_asking_for_the_base_beside_expert_adapters_is_an_error_naming_both_keys():
    with pytest.raises(ValidationError, match=r"`server.base_model_name` with `engine.lora.target_experts`"):
        InferenceConfig.model_validate({"model": {"name": "m"}, "server": {"base_model_name": "start"},
                                        "engine": {"lora": {**LORA, "target_experts": ["down_proj"]}}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", ["tiny", "tiny-glm4-moe"])
def test_cuda_fused_blocks_serve_base_rows_and_graphs_keep_the_policys_steps(preset, tmp_path, monkeypatch):
    """fp32 on CUDA: the fused blocks (stacked q/k/v and gate/up corrected part by part; GLM-4.5's shared experts)
    give base rows the base model's logprobs and policy rows the merged model's, against teacher-forced passes at
    the GPU tests' 1e-4 (times 1 + |W_merged| / |W_base|, module docstring); steps holding a base row run eagerly,
    and decode steps of policy rows alone still replay CUDA graphs."""
    folder = init_model(preset, tmp_path / "model", seed=0)
    adapter_folder(folder, tmp_path / "a", seed=2, std=ADAPTER_STD)
    engine = build_engine(ModelConfig(name=str(folder), dtype="float32"),
                          EngineConfig(device="cuda", max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64,
                                       overlap_steps=False, lora=LORA), seed=0, base="required")
    assert {block.forward.func for block in engine.runner.model.layers} == {fused_block_forward}
    assert engine.runner.graphs is not None
    engine.update_weights(read_adapter_folder(tmp_path / "a")[1])
    replays: list[bool] = []  # per replayed step: whether a base sequence was running
    replay = engine.runner.graphs.replay
    monkeypatch.setattr(engine.runner.graphs, "replay", lambda *a: replays.append(
        any(s.is_base for s in engine.scheduler.running)) or replay(*a))
    requests = [(False, PROMPTS[0], 24), (True, PROMPTS[1], 8), (False, PROMPTS[2], 24), (True, PROMPTS[0], 8)]
    for i, (is_base, prompt, max_tokens) in enumerate(requests):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True),
                           incremental=False, is_base=is_base)
    outputs = {}
    while engine.has_unfinished:
        outputs.update({out.request_id: out for out in engine.step()})
    assert replays and not any(replays)
    base_model = load_causal_lm(str(folder), "cpu", "float32")
    merged = load_causal_lm(str(export_merged(tmp_path / "a", tmp_path / "merged")), "cpu", "float32")
    bound = 10 * base_bound(folder, tmp_path / "a")
    for i, (is_base, prompt, _) in enumerate(requests):
        out = outputs[str(i)]
        expected = teacher_forced_logprobs(base_model if is_base else merged, prompt, out.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=bound, rtol=0)
