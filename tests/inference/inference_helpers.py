"""Helpers of the inference tests: server configs, teacher-forced logprobs, and how close an
engine computing in FP8 (weights, KV cache) stays to the unquantized model."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import torch

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig, InferenceConfig
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.kernels.fp8 import FP8
from tandem.models.loading import load_causal_lm
from tandem.models.lora import LoraSpec, apply_lora, lora_modules, write_adapter_folder

ENGINE = {"device": "cpu", "num_blocks": 512, "block_size": 16, "max_model_len": 1024, "max_num_seqs": 64, "max_num_batched_tokens": 1024}
"""Engine settings of the test servers: CPU (fp32, exact parity), an 8k-token cache allocated in no time."""

QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
"""The on-disk names of the weights an FP8 checkpoint of a dense Qwen3 holds in FP8."""


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": LORA_TARGETS}
"""`engine.lora` of the LoRA test servers: every projection adapted, rank 4, scale 2."""


def adapter_folder(base: Path, folder: Path, seed: int, rank: int = 4, std: float = 0.2) -> None:
    """A PEFT adapter folder for the model in `base` whose A and B are both random, of standard deviation `std` (B
    nonzero: a policy visibly not the base)."""
    model = load_causal_lm(str(base), "cpu", "float32")
    spec = LoraSpec(rank, 8.0, tuple(LORA_TARGETS))
    apply_lora(model, spec, source="test")
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in lora_modules(model):
        state[f"{name}.lora_A.weight"] = torch.randn(module.lora_A.weight.shape, generator=gen) * std
        state[f"{name}.lora_B.weight"] = torch.randn(module.lora_B.weight.shape, generator=gen) * std
    write_adapter_folder(folder, state, spec, str(base))


def teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float,
                            device: str = "cpu") -> torch.Tensor:
    """log_softmax(logits / T) of each completion token, from one forward pass over the whole sequence (on the CPU)."""
    ids = torch.tensor([prompt + completion], device=device)
    with torch.no_grad():
        logits = model.lm_head(model(ids, torch.arange(ids.shape[1], device=device)[None])).float()[0].cpu()
    scaled = logits / (temperature if temperature > 0 else 1.0)
    rows = scaled[len(prompt) - 1:-1].log_softmax(-1)
    return rows.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def check_teacher_forced(engine, model: torch.nn.Module, requests: dict, num_outputs: int, atol: float = 1e-4) -> list:
    """Step `engine` to its end (requests added with `incremental=False`; `requests`: id -> (prompt, params)); each
    output's logprobs against a teacher-forced pass of `model`. Returns the outputs."""
    outputs = []
    while engine.has_unfinished:
        outputs.extend(engine.step())
    assert len(outputs) == num_outputs
    for out in outputs:
        prompt, params = requests[out.request_id]
        expected = teacher_forced_logprobs(model, prompt, out.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=atol, rtol=0)
    return outputs


def make_config(model_dir: Path, **engine) -> InferenceConfig:
    return InferenceConfig.model_validate({"model": {"name": str(model_dir)}, "engine": {**ENGINE, **engine}})


def generate(engine, num_requests: int = 6, max_tokens: int = 24, seed: int = 0,
             n: int = 1) -> dict[str, tuple[list[int], list[int], list[float], float]]:
    """Random prompts sampled at several temperatures, `n` samples each; per sample: (prompt, completion, logprobs,
    temperature)."""
    rng = random.Random(seed)
    requests = {}
    for i in range(num_requests):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 60))]
        temperature = [0.0, 1.0, 0.7][i % 3]
        requests[str(i)] = (prompt, temperature)
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                                                          ignore_eos=True), n=n)
    results: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            key = out.request_id if n == 1 else f"{out.request_id}/{out.index}"
            ids, logprobs = results.setdefault(key, ([], []))
            ids += out.token_ids
            logprobs += out.logprobs
    assert len(results) == num_requests * n and all(len(ids) == max_tokens for ids, _ in results.values())
    return {key: (requests[key.split("/")[0]][0], ids, logprobs, requests[key.split("/")[0]][1])
            for key, (ids, logprobs) in results.items()}


def engine_for(model_dir, device: str = "cpu", quantization: str = "fp8", load_format: str = "safetensors", **settings):
    """An engine of the FP8 tests (`quantization` FP8 unless told) over `model_dir`, its other `engine` keys `settings`."""
    config = {"device": device, "num_blocks": 64, "block_size": 16, "max_model_len": 256, "max_num_batched_tokens": 256,
              "quantization": quantization, **settings}
    return build_engine(ModelConfig(name=str(model_dir), load_format=load_format), EngineConfig(**config), seed=0)


def fp8_state(engine) -> dict[str, torch.Tensor]:
    """The FP8 weights an engine holds and their scales, by in-memory name."""
    return {k: v for k, v in engine.weight_target.state_dict().items() if v.dtype == FP8 or k.endswith("_scale_inv")}


def assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """The same names and, bit for bit, the same values."""
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        as_bits = (lambda t: t.view(torch.uint8)) if tensor.dtype == FP8 else (lambda t: t)
        assert torch.equal(as_bits(tensor), as_bits(expected[name].to(tensor.device))), name


def fp8_rho(factors_per_block: int, num_layers: int) -> float:
    """How far FP8 moves logits, relative to their spread (their standard deviation over the vocabulary).

    e4m3 rounds a value by up to 2^-4 of itself, 2^-4 / sqrt(3) as a root mean square (uniform rounding); a product
    with one factor in FP8 is off by about that of its size, with both by sqrt(2) times that. The errors of the
    F factors rounded per block, over L blocks, add up like independent ones: logits move by about
    RHO = sqrt(F L) * 2^-4 / sqrt(3) of their spread. A token's logprob, its logit minus the log-sum-exp, moves by
    that on average and by at most about twice that in the tails."""
    return math.sqrt(factors_per_block * num_layers) * 2.0 ** -4 / math.sqrt(3)


def check_follows_fp8_scheme(results: dict, fp8_model: torch.nn.Module, unquantized: torch.nn.Module) -> None:
    """The engine's logprobs (`generate`'s results) against a teacher-forced pass of the same FP8 blocks
    (`fp8_model`). Activations are quantized per token, so batching changes only the order of fp32 sums; where that
    moves a value across an e4m3 rounding boundary, a later logprob moves by up to 2^-6. How often depends on the
    CPU's matmul kernels (which ones a batch's shape picks), so the check is: most tokens within 1e-5, none past
    2^-6, and the same 1e-5 met by hardly any token against the `unquantized` model (another scheme, told apart)."""
    def within_1e5(model: torch.nn.Module) -> tuple[float, float]:
        differences = torch.cat([(torch.tensor(logprobs) - teacher_forced_logprobs(model, prompt, ids, t)).abs()
                                 for prompt, ids, logprobs, t in results.values()])
        return (differences <= 1e-5).float().mean().item(), differences.max().item()

    share, worst = within_1e5(fp8_model)
    assert share >= 0.75 and worst <= 2.0 ** -6, (share, worst)
    assert within_1e5(unquantized)[0] <= 0.1


def check_close_to_unquantized(results: dict, model: torch.nn.Module, device: str, factors_per_block: int,
                               tails: float = 2.0) -> None:
    """Each sampled token's FP8 logprob against the unquantized model's, relative to the spread of its logits:
    within `fp8_rho` on average, `tails` RHO at most; and not equal (FP8 ran)."""
    rho = fp8_rho(factors_per_block, len(model.layers))
    ratios = []
    for prompt, ids, logprobs, temperature in results.values():
        tokens = torch.tensor([prompt + ids], device=device)
        with torch.no_grad():
            logits = model.lm_head(model(tokens, torch.arange(tokens.shape[1], device=device)[None]))[0].float().cpu()
        logits = logits[len(prompt) - 1:-1] / (temperature if temperature > 0 else 1.0)  # what the logprobs are of
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        ratios.append((torch.tensor(logprobs) - expected).abs() / logits.std(-1))
    ratios = torch.cat(ratios)
    assert ratios.mean() <= rho and ratios.max() <= tails * rho, (ratios.mean(), ratios.max(), rho)
    assert ratios.max() > 0


def check_against_replayed_routing(engine, model: torch.nn.Module, atol: float) -> None:
    """Eight random prompts of 1 to 120 tokens, n = 2 and 32 tokens each, through a CUDA `engine` of a mixture of
    experts; every sample's logprobs equal `model`'s teacher-forced pass with the experts the engine reports
    replayed (in bf16 a near tie routed otherwise would be another model, not an error), within `atol`."""
    from tandem.models.moe import replayed_routing

    rng = random.Random(0)
    prompts = {}
    for i in range(8):
        prompts[str(i)] = [rng.randrange(256) for _ in range(rng.randint(1, 120))]
        engine.add_request(str(i), prompts[str(i)], SamplingParams(max_tokens=32, ignore_eos=True, return_routed_experts=True),
                           n=2, incremental=False)
    outputs = []
    while engine.has_unfinished:
        outputs.extend(engine.step())
    assert len(outputs) == 16
    for out in outputs:
        prompt = prompts[out.request_id]
        routed = torch.tensor(out.routed_experts, device="cuda")
        replay = torch.full((len(prompt) + len(out.token_ids), *routed.shape[1:]), -1, device="cuda")
        replay[len(prompt) - 1:-1] = routed
        with replayed_routing(model, replay):
            expected = teacher_forced_logprobs(model, prompt, out.token_ids, 1.0, device="cuda")
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=atol, rtol=0)


def run_engine(engine, requests: list[tuple[bool, list[int]]]) -> list[list[float]]:
    """Every (is_base, prompt) added before the first step, so all run in the same steps; each one's logprobs."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, (is_base, prompt) in enumerate(requests):
        engine.add_request(str(i), prompt, params, is_base=is_base)
    logprobs: dict[str, list[float]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            logprobs.setdefault(out.request_id, []).extend(out.logprobs)
    return [logprobs[str(i)] for i in range(len(requests))]
