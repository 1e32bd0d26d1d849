"""`[run] exact = true`: the engine's logprobs equal the trainer's bitwise (`torch.equal`), whatever the batches
the engine formed (prefill chunks beside decodes, other sequences), single- and multi-turn, through the
orchestrator's samples, packing and the wire format. On the CPU in fp32 by both of exact mode's paths
(token by token; the Triton kernels under Triton's interpreter); on CUDA in bf16 with CUDA graphs."""

from __future__ import annotations

import random
import shutil
from pathlib import Path


import pytest
import torch
from counting_head import give_counting_head, give_counting_mtp_layer

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.config.lora import LoraConfig
from tandem.config.trainer import ParallelConfig
from tandem.inference.engine.llm_engine import EngineStats
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.models.exact import model_uses_kernels
from tandem.models.loading import load_causal_lm
from tandem.models.lora import LoraSpec, apply_lora, is_adapter_name
from tandem.models.presets import PRESETS, shape_config, write_model
from tandem.orchestrator.packing import pack_step
from tandem.orchestrator.samples import Turn, build_samples
from tandem.trainer.micro_batch import MicroBatch
from tandem.trainer.model import build_policy, load_shards
from tandem.trainer.parallel.dims import close_parallel, init_parallel
from tandem.transport.types import decode_batch, encode_batch

from trainer_helpers import metrics, run_trainer
from triton_interpreter import needs_triton_interpreter, run_interpreted

NUM_TURNS = {0: 1, 1: 2, 2: 1, 3: 2}
"""Conversation -> model turns (1: single-turn, 2: multi-turn)."""


LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


LATENT_LORA = LoraConfig(enabled=True, rank=4, alpha=8.0,
                         target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
                         target_experts=["gate_up_proj", "down_proj"])


EXPERT_LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "o_proj"],
                         target_experts=["gate_up_proj", "down_proj"])


def trained_adapters(model_folder: Path, lora: LoraConfig = LORA) -> dict[str, torch.Tensor]:
    """Adapters as training leaves them (A and B away from their start), for everything `lora` targets."""
    model = load_causal_lm(str(model_folder), "cpu", "float32")
    apply_lora(model, LoraSpec(lora.rank, lora.alpha, tuple(lora.target_modules), tuple(lora.target_experts)), source="test")
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(param.shape, generator=gen) * 0.2 for name, param in model.named_parameters()
            if is_adapter_name(name)}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
"""fp32 on the CPU; bf16 (`model.dtype = auto`) on CUDA."""


@pytest.fixture
def dims(request):
    d = init_parallel(getattr(request, "param", "cpu"))
    yield d
    close_parallel()


def sample_conversations(model_folder, max_num_batched_tokens: int, staggered: bool, device: str = "cpu",
                         adapters: dict[str, torch.Tensor] | None = None, lora: LoraConfig = LORA,
                         speculative: dict | None = None, temperature: float = 0.7,
                         dtype: str = "auto") -> tuple[dict[int, list[Turn]], EngineStats]:
    """Conversations from an exact engine, and its stats; `staggered`: each new turn joins while others decode
    (mixed batches), else each request runs alone. `adapters`: the policy is `lora` with these adapters.
    `speculative`: `engine.speculative` (which needs the overlapped step off). `temperature`: 0 for greedy.
    `dtype`: `model.dtype`."""
    engine = build_engine(ModelConfig(name=str(model_folder), dtype=dtype), EngineConfig(
        device=device, num_blocks=128, max_model_len=256, max_num_batched_tokens=max_num_batched_tokens,
        lora=lora if adapters else LoraConfig(), speculative=speculative or {}, overlap_steps=not speculative),
        seed=0, exact=True)
    if adapters:
        engine.update_weights(adapters)
    runner = engine.runner  # decode steps replay CUDA graphs wherever the whole forward takes the kernel path
    assert (runner.graphs is not None) == (device == "cuda" and model_uses_kernels(runner.model, torch.device(device)))
    rng = random.Random(0)
    prompts = {c: [rng.randrange(256) for _ in range(rng.randint(3, 40))] for c in NUM_TURNS}
    turns: dict[int, list[Turn]] = {c: [] for c in NUM_TURNS}

    def add(c: int) -> None:
        params = SamplingParams(max_tokens=6 + c, seed=c * 10 + len(turns[c]), temperature=temperature, ignore_eos=True)
        engine.add_request(f"{c}-{len(turns[c])}", prompts[c], params, incremental=False)

    waiting = list(NUM_TURNS)
    while waiting or engine.has_unfinished:
        if waiting and (staggered or not engine.has_unfinished):
            add(waiting.pop(0))
        for out in engine.step():
            c = int(out.request_id.split("-")[0])
            # Greedy tokens report their logprob at T = 1, which the trainer then computes.
            turns[c].append(Turn(prompts[c], out.token_ids, out.logprobs, 0, temperature or 1.0))
            if len(turns[c]) < NUM_TURNS[c]:  # an environment reply, then the next model turn
                prompts[c] = prompts[c] + out.token_ids + [rng.randrange(256) for _ in range(4)]
                waiting.append(c)
    return turns, engine.stats()


@pytest.mark.parametrize("model", ["tiny_model", "tiny_moe_model"])
@pytest.mark.parametrize("dims", DEVICES, indirect=True)
def test_engine_logprobs_equal_the_trainers_bitwise(model, dims, request):
    check_parity(request.getfixturevalue(model), dims)  # dense, and a mixture of experts (routing token by token too)


@pytest.mark.parametrize("dims", DEVICES, indirect=True)
def test_a_lora_policy_keeps_exact_parity(tiny_model, dims):
    """The engine multiplies by merged weights, the trainer by base + adapters formed at each forward: the one
    function `adapted_weight` makes them the same matrices, so exact mode holds for LoRA policies too."""
    check_parity(tiny_model, dims, alone=False, adapters=trained_adapters(tiny_model))


@pytest.mark.parametrize("dims", DEVICES, indirect=True)
def test_expert_adapters_keep_exact_parity(tiny_moe_model, dims):
    """The same for adapters on every routed expert: the engine's merged stacks are the trainer's adapted ones."""
    check_parity(tiny_moe_model, dims, alone=False, adapters=trained_adapters(tiny_moe_model, EXPERT_LORA), lora=EXPERT_LORA)


LATENT_SHAPES = {
    # Two blocks: a full DSA layer (dense feed-forward), then a shared one (a mixture of experts).
    "glm5-top-k-within-the-contexts": dict(PRESETS["tiny-glm5"], num_hidden_layers=2, index_topk=8),
    "glm5-top-k-past-the-contexts": dict(PRESETS["tiny-glm5"], num_hidden_layers=2, index_topk=256),
    "deepseek-v3": dict(PRESETS["tiny-deepseek-v3"], num_hidden_layers=2),
}
"""Latent attention models; the conversations' contexts run from 3 to about 70 tokens."""


@pytest.mark.parametrize("shape", list(LATENT_SHAPES))
@pytest.mark.parametrize("dims", DEVICES, indirect=True)
def test_latent_attention_keeps_exact_parity(shape, dims, tmp_path):
    """GLM-5 (DSA's top-k choosing among the context, and not) and DeepSeek-V3: the engine's prefill chunks and
    decodes read each token's latent entries from its paged cache, the trainer from its packed rows, and both attend
    to them in the absorbed form one token at a time (`tandem.models.exact_latent`). Each request alone too where
    DSA chooses (the other shapes' blocks differ from it only by what they leave out)."""
    check_parity(write_model(shape_config(LATENT_SHAPES[shape]), tmp_path / "m"), dims,
                 alone=shape == "glm5-top-k-within-the-contexts")


@pytest.mark.parametrize("dims", DEVICES, indirect=True)
def test_latent_adapters_keep_exact_parity(sparse_latent_model, dims):
    """Adapters on every MLA projection and routed expert of GLM-5's blocks: both sides multiply by the adapted
    weights `adapted_weight` forms, merged in the engine."""
    check_parity(sparse_latent_model, dims, alone=False, adapters=trained_adapters(sparse_latent_model, LATENT_LORA),
                 lora=LATENT_LORA)


def test_latent_adapters_keep_exact_parity_in_bf16_on_the_cpu(sparse_latent_model, dims):
    """The same in bf16, as CUDA runs it: the trainer's mixed precision and frozen LoRA base keep GLM's routers fp32
    as the engine holds them (`moe.fp32_routers`); rounded to bf16, a near tie routed one token otherwise."""
    check_parity(sparse_latent_model, dims, alone=False, adapters=trained_adapters(sparse_latent_model, LATENT_LORA),
                 lora=LATENT_LORA, dtype="bfloat16")


INTERPRETED = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from tandem.models.presets import init_model
from tandem.trainer.parallel.dims import close_parallel, init_parallel
from test_exact_parity import check_parity
from triton_interpreter import dots_row_by_row

dots_row_by_row()
dims = init_parallel("cpu")
check_parity(init_model("tiny", Path({folder!r}), seed=0), dims, alone=False)
close_parallel()
print("ok")
"""


@needs_triton_interpreter
def test_the_kernel_path_under_tritons_interpreter(tmp_path):
    """The GPU's path on the CPU: Triton kernels (linear, norms, attention as one decode query per token,
    log_softmax) in engine and trainer, a dense model; mixed batches only (the interpreter is slow; a row alone
    among others: `tests/kernels/test_batch_invariant.py`)."""
    script = INTERPRETED.format(tests=str(Path(__file__).parent), folder=str(tmp_path / "tiny"))
    run_interpreted(script, timeout=600)


def check_parity(tiny_model: Path, dims, alone: bool = True, adapters: dict[str, torch.Tensor] | None = None,
                 lora: LoraConfig = LORA, dtype: str = "auto") -> None:
    """Conversations from an exact engine, staggered (and `alone`: each request alone, the same tokens and
    logprobs), then the trainer's logprobs of their packed samples. `adapters`: a LoRA policy (`lora`) on both sides;
    `dtype`: both sides' `model.dtype`."""
    device = dims.device.type
    mixed, _ = sample_conversations(tiny_model, max_num_batched_tokens=16, staggered=True, device=device,
                                    adapters=adapters, lora=lora, dtype=dtype)
    if alone:
        by_itself, _ = sample_conversations(tiny_model, max_num_batched_tokens=512, staggered=False, device=device,
                                            dtype=dtype)
        # Batch-invariant engine: the same seeds draw the same tokens with the same logprobs in any batch.
        assert_same_conversations(mixed, by_itself)
    check_trainer_logprobs(tiny_model, dims, mixed, adapters, lora, dtype)


def assert_same_conversations(a: dict[int, list[Turn]], b: dict[int, list[Turn]]) -> None:
    """The same tokens with bitwise the same logprobs."""
    for c in NUM_TURNS:
        assert [t.completion_ids for t in a[c]] == [t.completion_ids for t in b[c]]
        assert [t.logprobs for t in a[c]] == [t.logprobs for t in b[c]]


def check_trainer_logprobs(tiny_model: Path, dims, turns: dict[int, list[Turn]],
                           adapters: dict[str, torch.Tensor] | None = None, lora: LoraConfig = LORA,
                           dtype: str = "auto") -> None:
    """The exact trainer's logprobs of the conversations' packed samples equal the engine's bitwise, every one
    (`dtype`: the trainer's `model.dtype`)."""
    samples = [s for c in NUM_TURNS for s in build_samples(turns[c])]
    assert len(samples) == len(NUM_TURNS)  # multi-turn conversations stay one sample each
    batches, _ = pack_step(1, samples, seq_len=256, num_ranks=1, pad_token_id=0)
    rows = decode_batch(encode_batch(batches[0])).rows
    assert any(sum(p == 0 for p in row.position_ids) > 1 for row in rows)  # packed rows: several documents
    # Head chunks of 5 rows: a row's logprob does not depend on the chunk it is computed in.
    policy, _ = build_policy(ModelConfig(name=str(tiny_model), dtype=dtype), ParallelConfig(), dims, chunk_size=5,
                             exact=True, lora=lora if adapters else LoraConfig())
    if adapters:
        load_shards(policy, adapters, "the test's adapters", policy.adapter_parameters())
    num_loss_tokens = 0
    with torch.no_grad():
        for row in rows:
            mb = MicroBatch.from_row(row, dims.device)
            out = policy(mb.input_ids, mb.position_ids, mb.temperatures, mb.loss_mask)
            mask = mb.loss_mask[0]
            assert torch.equal(out.logprobs[0][mask], mb.inference_logprobs[0][mask])
            num_loss_tokens += int(mask.sum())
    assert num_loss_tokens == sum(6 + c for c in NUM_TURNS for _ in range(NUM_TURNS[c]))


@pytest.fixture(scope="module")
def sharp_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with a counting head (`counting_head.py`): its samples at T = 0.7 are often its greedy
    choice, so that drafts get accepted at that temperature too."""
    folder = tmp_path_factory.mktemp("sharp") / "tiny"
    shutil.copytree(tiny_model, folder)
    return give_counting_head(folder)


@pytest.fixture(scope="module")
def counting_mtp_model(tmp_path_factory) -> Path:
    """One GLM-5 block (DSA choosing 8 tokens) with a counting head and an MTP layer that drafts the count
    (`counting_head.py`): its drafts get accepted."""
    shape = dict(LATENT_SHAPES["glm5-top-k-within-the-contexts"], num_hidden_layers=1)
    folder = tmp_path_factory.mktemp("counting-mtp") / "m"
    return give_counting_mtp_layer(give_counting_head(write_model(shape_config(shape), folder)))


@pytest.mark.parametrize(("model", "draft", "temperature"), [
    ("sharp_model", "ngram", 0.0),
    ("sharp_model", "ngram", 0.7),
    ("sharp_model", "greedy-draft-model", 0.0),
    ("sharp_model", "greedy-draft-model", 0.7),
    ("tiny_moe_model", "ngram", 0.0),  # a mixture of experts: blocks token by token on every device
    ("counting_mtp_model", "mtp", 0.7),  # latent attention, drafted by its own multi-token prediction layer
])
@pytest.mark.parametrize("dims", DEVICES, indirect=True)
def test_speculation_keeps_exact_tokens_and_logprobs(model, draft, temperature, dims, request):
    """Deterministic drafts (n-gram; a greedy draft model, here the policy's own weights on the engine's ordinary
    path; a latent model's own multi-token prediction layer, greedy): the same seeds give the same tokens with bitwise the same logprobs as exact mode without speculation,
    and those are the trainer's. The verifying forward computes each of a sequence's k + 1 tokens as that token's
    own decode step would, and speculation keeps exactly the tokens the policy samples."""
    folder = request.getfixturevalue(model)
    device = dims.device.type
    # n-gram drafts wherever lookup matches (`min_expected_tokens` = 0): these short outputs rarely copy their prompts.
    speculative = {"ngram": {"method": "ngram", "num_tokens": 3, "min_expected_tokens": 0},
                   "mtp": {"method": "mtp", "num_tokens": 3},
                   "greedy-draft-model": {"method": "draft_model", "draft_model": str(folder)}}[draft]
    plain, _ = sample_conversations(folder, max_num_batched_tokens=512, staggered=False, device=device,
                                    temperature=temperature)
    speculated, stats = sample_conversations(folder, max_num_batched_tokens=16, staggered=True, device=device,
                                             speculative=speculative, temperature=temperature)
    assert stats.num_accepted_tokens > 0
    assert_same_conversations(speculated, plain)
    check_trainer_logprobs(folder, dims, speculated)


@pytest.mark.parametrize("dims", DEVICES, indirect=True)
def test_a_sampled_draft_keeps_the_trainers_logprobs(sharp_model, dims):
    """Rejection sampling draws other tokens for a seed than decoding without speculation, but each token's
    logprob is still the policy's, from the verifying forward: the trainer's bit for bit."""
    speculative = {"method": "draft_model", "draft_model": str(sharp_model), "draft_sampling": "sampled"}
    turns, stats = sample_conversations(sharp_model, max_num_batched_tokens=16, staggered=True,
                                        device=dims.device.type, speculative=speculative)
    assert stats.num_accepted_tokens > 0
    check_trainer_logprobs(sharp_model, dims, turns)


def test_without_exact_the_paths_differ(tiny_model, dims):
    """The check above can fail: the default kernels (SDPA on packed rows, batched matmuls) round otherwise."""
    turns, _ = sample_conversations(tiny_model, max_num_batched_tokens=16, staggered=True)
    batches, _ = pack_step(1, [s for c in NUM_TURNS for s in build_samples(turns[c])], seq_len=256, num_ranks=1, pad_token_id=0)
    policy, _ = build_policy(ModelConfig(name=str(tiny_model)), ParallelConfig(), dims, chunk_size=64)
    differ = []
    with torch.no_grad():
        for row in batches[0].rows:
            mb = MicroBatch.from_row(row, dims.device)
            out = policy(mb.input_ids, mb.position_ids, mb.temperatures, mb.loss_mask)
            mask = mb.loss_mask[0]
            differ.append(not torch.equal(out.logprobs[0][mask], mb.inference_logprobs[0][mask]))
            torch.testing.assert_close(out.logprobs[0][mask], mb.inference_logprobs[0][mask], atol=1e-4, rtol=0)
    assert any(differ)


def test_exact_refuses_a_transformers_model(llama_model, dims):
    with pytest.raises(ValueError, match="falls back to transformers"):
        build_policy(ModelConfig(name=str(llama_model)), ParallelConfig(), dims, chunk_size=64, exact=True)
    with pytest.raises(ValueError, match="falls back to transformers"):
        build_engine(ModelConfig(name=str(llama_model)), EngineConfig(device="cpu", num_blocks=8, max_model_len=64), seed=0,
                     exact=True)


@pytest.fixture(scope="module")
def sparse_latent_model(tmp_path_factory) -> Path:
    """GLM-5's blocks choosing 8 tokens: training rows of 16 tokens choose for their last ones."""
    shape = LATENT_SHAPES["glm5-top-k-within-the-contexts"]
    return write_model(shape_config(shape), tmp_path_factory.mktemp("sparse-latent") / "m")


@pytest.mark.parametrize("model", ["tiny_model", "sparse_latent_model"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_trainer_trains_in_exact_mode(model, tmp_path, device, request):
    """Backward runs through exact mode's forward (whole-block recompute): token by token on the CPU, through
    the kernels' torch backward passes on CUDA; latent attention blocks by torch's autograd everywhere."""
    args = ["--model.name", str(request.getfixturevalue(model)), "--run.exact", "true", "--data.fake", "--max-steps", "2",
            "--output-dir", str(tmp_path), "--seq-len", "16", "--optim.lr", "1e-3", "--logprob-chunk-size", "5"]
    if device == "cpu":
        assert run_trainer(*args) == 0
    else:
        from tandem.config.loader import parse_args
        from tandem.config.trainer import TrainerConfig
        from tandem.trainer.rl.train import main

        assert main(parse_args(TrainerConfig, ["--device", "cuda", *args], environ={})) == 0
    records = metrics(tmp_path)
    assert [r["skipped"] for r in records] == [0, 0] and records[1]["loss"] != records[0]["loss"]
    assert all(r["grad_norm"] > 0 for r in records)
