"""The policy's multi-token prediction layer as the speculative draft (`engine.speculative.method` = 'mtp'): its
drafts are what the layer computes from the policy's hidden states, and the tokens and logprobs stay the policy's."""

import shutil

import httpx
import pytest
import torch
from counting_head import give_counting_head, give_counting_mtp_layer
from inference_helpers import make_config, teacher_forced_logprobs
from test_admin import metric
from test_engine import engine_for, run
from test_speculative import seeded_requests

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.admin_api import read_update_folder
from tandem.inference.engine.fp8_blocks import apply_fp8_blocks
from tandem.inference.engine.fused_moe import fused_moe_forward
from tandem.inference.engine.kv_cache import KVCache
from tandem.inference.engine.setup import build_engine
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.server import BackgroundServer
from tandem.models.fp8 import Fp8Linear
from tandem.models.loading import load_causal_lm
from tandem.models.presets import PRESETS, init_model, shape_config, write_model

SHAPES = {
    "glm5-sparse": dict(PRESETS["tiny-glm5"], index_topk=4),  # DSA chooses for the MTP layer's queries too
    "deepseek-v3": PRESETS["tiny-deepseek-v3"],
    "qwen3-head": dict(PRESETS["tiny"], num_nextn_predict_layers=1),  # a decoder family's draft head, over `KVCache`
    "glm4-moe-mtp": dict(PRESETS["tiny-glm4-moe"], num_nextn_predict_layers=1),  # GLM-4.5's own: a routed block
}
SETTINGS = {
    "roomy": dict(block_size=4, num_blocks=256, max_model_len=128),
    # 24 blocks of 4 tokens and a 24-token budget: chunked prefills, preemptions, drafts short of room.
    "memory-starved": dict(block_size=4, num_blocks=24, max_num_batched_tokens=24, max_model_len=64),
}


def mtp_engine(folder, settings="roomy", **speculative):
    return engine_for(folder, speculative={"method": "mtp", "num_tokens": 3, **speculative}, **SETTINGS[settings])


def record_drafts(engine) -> list[tuple[object, int, list[int]]]:
    """Every proposal as the engine runs: the sequence, how many tokens it held, the drafts proposed after them."""
    proposer = engine.speculator.proposer
    propose = proposer.propose
    seen = []

    def recording(batch):
        distributions = propose(batch)
        seen.extend((seq, seq.num_tokens, drafts) for seq, drafts in zip(batch.seqs, batch.drafts) if drafts)
        return distributions

    proposer.propose = recording
    return seen


@torch.no_grad()
def reference_drafts(model, hidden: torch.Tensor, tokens: list[int], num_drafts: int) -> list[int]:
    """Greedy drafts after `tokens` by calling the MTP layer on a teacher-forced pass (`hidden`: the policy's final
    hidden states of `tokens`): the layer over every position t (the hidden state at t, token t + 1); each further
    draft with the layer's output at the last position as the hidden state of the next and the draft before as
    its token."""
    hidden, following = hidden[:-1], tokens[1:]
    drafts = []
    for _ in range(num_drafts):
        positions = torch.arange(len(following), device=hidden.device)[None]
        out = model.predict_after_next(hidden[None], torch.tensor([following], device=hidden.device), positions)[0, -1]
        drafts.append(int(model.lm_head(out).argmax()))
        hidden = torch.cat([hidden, out[None]])
        following = following + drafts[-1:]
    return drafts


def check_drafts_are_the_layers(folder, settings: str, quantization: str = "none", device: str = "cpu"):
    """Run prompts through an engine drafting with the MTP layer, in fp32 (CUDA's default, bf16, ties a tiny model's
    logits too often to compare drafts); each proposal equals the layer's greedy drafts called on a teacher-forced
    pass: all of them on the CPU; where the engine's arithmetic
    differs from the reference's in its roundings (FP8 activations quantized per batch row, the engine's kernels on
    CUDA), a near tie of the layer's logits may draft otherwise, so most of them. Returns the engine."""
    fp8 = quantization == "fp8"
    engine = engine_for(folder, speculative={"method": "mtp", "num_tokens": 3}, quantization=quantization, fp8_experts=fp8,
                        device=device, dtype="float32", **SETTINGS[settings])
    seen = record_drafts(engine)
    for i in range(4):
        prompt = [(7 * i + 3 * j) % 256 for j in range(5 + 9 * i)]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=12, temperature=[0.0, 1.0][i % 2], seed=i,
                                                          ignore_eos=True), n=2)
    run(engine)
    if settings == "memory-starved":
        assert engine.stats().num_preemptions > 0
    cache = engine.runner.cache
    held = cache.keys if isinstance(cache, KVCache) else cache.entries
    assert not held.requires_grad  # the layer's writes keep no autograd history (it would grow every step)
    # One requires_grad for every weight: CUDA's compiled router guards on it, and the layer's once differed.
    assert not any(p.requires_grad for p in engine.weight_target.model.parameters())
    model = load_causal_lm(str(folder), device, "float32", quantization=quantization, fp8_experts=fp8)
    if fp8:
        assert isinstance(engine.weight_target.model.mtp_layers[0].self_attn.o_proj, Fp8Linear)
        apply_fp8_blocks(model, kernels=False)
    assert len(seen) > 20 and max(len(drafts) for _, _, drafts in seen) == 3
    hidden = {}  # per sequence, a teacher-forced pass over all its tokens: causal, so its rows hold for any prefix
    equal = []
    for seq, num_tokens, drafts in seen:
        if seq not in hidden:
            with torch.no_grad():
                hidden[seq] = model(torch.tensor([seq.token_ids], device=device),
                                    torch.arange(seq.num_tokens, device=device)[None])[0]
        tokens = seq.token_ids[:num_tokens]
        equal.append(drafts == reference_drafts(model, hidden[seq][:num_tokens], tokens, len(drafts)))
        assert fp8 or device != "cpu" or equal[-1], tokens
    assert sum(equal) >= 0.9 * len(equal)
    return engine


@pytest.mark.parametrize("shape, settings, quantization", [("glm5-sparse", "roomy", "none"),
                                                           ("glm5-sparse", "memory-starved", "none"),
                                                           ("deepseek-v3", "roomy", "none"), ("glm5-sparse", "roomy", "fp8"),
                                                           ("qwen3-head", "roomy", "none"),
                                                           ("qwen3-head", "memory-starved", "none"),
                                                           ("qwen3-head", "roomy", "fp8"), ("glm4-moe-mtp", "roomy", "none")])
def test_drafts_are_the_mtp_layers_own(shape, settings, quantization, tmp_path):
    """In FP8 (`engine.quantization`: the layer's projections (and experts) held in FP8 as the trunk's are) the
    reference is the same FP8 model run by the engine's FP8 blocks outside the engine (`check_follows_fp8_scheme`
    says how their roundings part)."""
    check_drafts_are_the_layers(write_model(shape_config(SHAPES[shape]), tmp_path / "m"), settings, quantization)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_on_cuda_the_mtp_layers_experts_run_the_engines_kernels(quantization, tmp_path):
    """fp32 on CUDA: the layer's mixture of experts runs the engine's fused kernels as the trunk's do (its routing not
    recorded), in FP8 on FP8 experts, and the drafts stay the layer's own."""
    folder = write_model(shape_config(SHAPES["glm5-sparse"]), tmp_path / "m")
    engine = check_drafts_are_the_layers(folder, "roomy", quantization, "cuda")
    forward = engine.weight_target.model.mtp_layers[0].mlp.forward
    assert forward.func is fused_moe_forward and forward.args[2] is None


@pytest.fixture(scope="module")
def counting_dir(tmp_path_factory):
    """tiny-glm5 with a counting LM head (`give_counting_head`: token t's embedding scores t + 1), so that its
    greedy completions often count up; its MTP layer keeps random weights. Its DSA keeps every token: a top-k
    over the near-equal index scores of repeated tokens may choose apart in a teacher-forced pass."""
    return give_counting_head(write_model(shape_config(PRESETS["tiny-glm5"]), tmp_path_factory.mktemp("c") / "model"))


@pytest.fixture(scope="module")
def counting_mtp_dir(counting_dir, tmp_path_factory):
    """`counting_dir` with an MTP layer that passes token t + 1's embedding on to the LM head (its attention and
    feed-forward add nothing), which then drafts t + 2: right wherever the policy counts."""
    folder = tmp_path_factory.mktemp("counting_mtp") / "model"
    shutil.copytree(counting_dir, folder)
    return give_counting_mtp_layer(folder)


def generate(engine, num_requests: int = 6) -> dict:
    engine.eos_token_ids = {7, 33}  # tokens the tiny model samples: some completions stop at EOS
    for rid, prompt, params in seeded_requests(num_requests):
        engine.add_request(rid, prompt, params, n=2)
    return run(engine)


@pytest.mark.parametrize("draft_sampling", ["greedy", "sampled"])
def test_tokens_and_logprobs_are_the_policys(counting_mtp_dir, draft_sampling):
    """Greedy and seeded requests, n = 2, stop strings, stop tokens and max_tokens: greedy drafts give the tokens
    and logprobs of the same seed without speculation; sampled ones other tokens, of the same distribution; both
    report the policy's teacher-forced logprobs."""
    engine = mtp_engine(counting_mtp_dir, draft_sampling=draft_sampling)
    speculated = generate(engine)
    stats = engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert {r["finish"] for r in speculated.values()} == {"stop", "length"}
    if draft_sampling == "greedy":
        plain = generate(engine_for(counting_mtp_dir, **SETTINGS["roomy"]))
        assert plain.keys() == speculated.keys() and len(plain) == 12
        for key, r in plain.items():
            s = speculated[key]
            assert (s["ids"], s["text"], s["finish"]) == (r["ids"], r["text"], r["finish"]), key
            torch.testing.assert_close(torch.tensor(s["logprobs"]), torch.tensor(r["logprobs"]), atol=1e-5, rtol=1e-5)
    model = load_causal_lm(str(counting_mtp_dir))
    requests = {rid: (prompt, params) for rid, prompt, params in seeded_requests(6)}
    for (rid, _), r in speculated.items():
        prompt, params = requests[rid]
        expected = teacher_forced_logprobs(model, prompt, r["ids"], params.temperature)
        # fp32 sums of other batch shapes, and of other orders at more than one torch thread (outside the workers)
        torch.testing.assert_close(torch.tensor(r["logprobs"]), expected, atol=1e-4, rtol=1e-5)


def test_a_weight_update_reaches_the_mtp_layer(counting_dir, counting_mtp_dir):
    """The MTP layer is part of the policy's weights: an update that carries it (read as the update route reads a
    published folder) drafts with the new layer, whose drafts the policy accepts where the random one's it did not."""
    engine = mtp_engine(counting_dir)
    generate(engine)
    before = engine.stats()
    state, _ = read_update_folder(counting_mtp_dir, engine.weight_target)
    assert any(name.startswith("model.mtp_layers.0.") for name in state)
    engine.update_weights(state)
    torch.testing.assert_close(engine.runner.model.model.mtp_layers[0].eh_proj.weight,
                               state["model.mtp_layers.0.eh_proj.weight"], atol=0, rtol=0)
    generate(engine)
    after = engine.stats()
    drafted, accepted = (after.num_draft_tokens - before.num_draft_tokens,
                         after.num_accepted_tokens - before.num_accepted_tokens)
    assert before.num_accepted_tokens < 0.05 * before.num_draft_tokens
    assert accepted > 0.15 * drafted


def test_metrics_count_the_mtp_drafts(counting_mtp_dir):
    running = BackgroundServer(make_config(counting_mtp_dir, speculative={"method": "mtp"}))
    try:
        httpx.post(f"{running.url}/v1/generate", timeout=60, json={
            "prompt_token_ids": list(range(10, 40)), "max_tokens": 30, "temperature": 0, "ignore_eos": True})
        text = httpx.get(f"{running.url}/metrics").text
    finally:
        running.stop()
    drafted, accepted = (metric(text, name) for name in ("tandem_spec_decode_draft_tokens_total",
                                                         "tandem_spec_decode_accepted_tokens_total"))
    assert drafted > accepted > 0


def test_a_model_without_an_mtp_layer_is_refused(tiny_dir, tmp_path):
    no_layer = write_model(shape_config(dict(PRESETS["tiny-glm5"], num_nextn_predict_layers=0)), tmp_path / "m")
    for folder, reason in ((no_layer, "`num_nextn_predict_layers` = 0"), (tiny_dir, "qwen3")):
        with pytest.raises(ValueError, match="`engine.speculative.method` = 'mtp'") as err:
            mtp_engine(folder)
        assert str(folder) in str(err.value) and reason in str(err.value)


def test_the_memory_plan_counts_the_mtp_layers_entries(tmp_path):
    """The MTP layer's entries (and its DSA indexer's keys) are layers of the policy's latent cache: a block
    costs them too, so the same memory holds fewer blocks."""
    shape = PRESETS["tiny-glm5"]
    folder = write_model(shape_config(shape), tmp_path / "m")
    plain, mtp = (engine_for(folder, speculative=spec, block_size=4, num_blocks=None, cpu_kv_cache_gib=1 / 1024,
                             max_num_seqs=64, max_model_len=256) for spec in ({}, {"method": "mtp"}))
    layers, full = shape["num_hidden_layers"], 2  # indexer_types: full, shared, full, shared; the MTP layer indexes
    entry = shape["kv_lora_rank"] + shape["qk_rope_head_dim"]
    cache = mtp.runner.cache
    assert cache.entries.shape[0] == layers + 1 and cache.index_keys.shape[0] == full + 1
    per_block = 4 * ((layers + 1) * entry + (full + 1) * shape["index_head_dim"]) * 4  # block_size 4, fp32
    assert mtp.block_manager.num_blocks == 2**20 // per_block < plain.block_manager.num_blocks


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    """Tiny Qwen3 with a random draft head (`tandem model init --draft-head`) and a counting LM head."""
    return give_counting_head(init_model("tiny", tmp_path_factory.mktemp("head") / "model", draft_head=True))


@pytest.fixture(scope="module")
def counting_head_dir(head_dir, tmp_path_factory):
    """`head_dir` with a head that drafts t + 2 wherever the policy counts (`give_counting_mtp_layer`)."""
    folder = tmp_path_factory.mktemp("counting_head") / "model"
    shutil.copytree(head_dir, folder)
    return give_counting_mtp_layer(folder)


def exact_engine(folder, **speculative):
    return build_engine(ModelConfig(name=str(folder)), EngineConfig(device="cpu", num_blocks=128, block_size=4,
                                                                    max_model_len=128, speculative=speculative),
                        seed=0, exact=True)


def test_a_draft_head_in_exact_mode_gives_bitwise_the_tokens_and_logprobs_without_speculation(counting_head_dir):
    """A decoder family's head drafts over the paged `KVCache` (its keys and values one more layer): in exact mode
    its greedy drafts change neither a token nor a logprob's bit, for greedy and seeded requests alike."""
    plain = generate(exact_engine(counting_head_dir))
    engine = exact_engine(counting_head_dir, method="mtp", num_tokens=3)
    speculated = generate(engine)
    stats = engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.runner.cache.keys.shape[0] == PRESETS["tiny"]["num_hidden_layers"] + 1
    assert speculated == plain


def train_head(model, sequences: list[list[int]], steps: int) -> None:
    """The head alone, trained as `mtp.train` trains it (cross-entropy on token t + 2, the trunk detached), for
    `steps` steps over all of `sequences` (of one length) at once."""
    head = model.model.mtp_layers
    head.requires_grad_(True)
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    ids = torch.tensor(sequences)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        hidden = model(ids, positions)
    for _ in range(steps):
        draft = model.predict_after_next(hidden, ids.roll(-1, 1), positions, detach_inputs=True)
        loss = torch.nn.functional.cross_entropy(model.lm_head(draft[:, :-2]).flatten(0, 1), ids[:, 2:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    head.requires_grad_(False)


def acceptance(engine, requests) -> float:
    before = engine.stats()
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out = run(engine)
    after = engine.stats()
    acceptance.outputs = out
    return (after.num_accepted_tokens - before.num_accepted_tokens) / (after.num_draft_tokens - before.num_draft_tokens)


def test_a_head_trained_on_the_policys_samples_drafts_better_than_a_random_one(head_dir):
    """The point of training the head online: trained on what the policy samples (the mtp loss), it is accepted
    far more often than the random head it started as, on prompts it was not trained on; an update carries it to
    the serving engine."""
    def requests(first: int, num: int) -> list:
        return [(str(i), [(11 * i + 5 * j) % 256 for j in range(6)],
                 SamplingParams(max_tokens=40, temperature=0.7, seed=i, ignore_eos=True)) for i in range(first, first + num)]

    engine = mtp_engine(head_dir)
    random_head = acceptance(engine, requests(0, 16))
    samples = [list(prompt) + acceptance.outputs[(rid, 0)]["ids"] for rid, prompt, _ in requests(0, 16)]
    model = load_causal_lm(str(head_dir))
    train_head(model, samples, 100)
    engine.update_weights(model.state_dict())
    held_out = requests(100, 12)
    trained_head = acceptance(engine, held_out)
    engine.update_weights(load_causal_lm(str(head_dir)).state_dict())
    random_held_out = acceptance(engine, [(f"random-{rid}", p, params) for rid, p, params in held_out])
    # The policy (a counting head over a random trunk) is itself hard to predict two tokens ahead: the layer that
    # drafts t + 2 wherever it counts is accepted for about a sixth of its drafts on these prompts.
    assert max(random_head, random_held_out) < 0.01 and trained_head > 0.04, (random_head, random_held_out, trained_head)


def test_the_memory_plan_counts_a_draft_heads_keys_and_values(head_dir):
    """A draft head's keys and values are one more layer of the policy's `KVCache`: a block costs them too."""
    plain, mtp = (engine_for(head_dir, speculative=spec, block_size=4, num_blocks=None, cpu_kv_cache_gib=1 / 1024,
                             max_num_seqs=64, max_model_len=256) for spec in ({}, {"method": "mtp"}))
    shape = PRESETS["tiny"]
    layers = shape["num_hidden_layers"]
    assert mtp.runner.cache.keys.shape[0] == layers + 1 and plain.runner.cache.keys.shape[0] == layers
    per_block = 2 * (layers + 1) * 4 * shape["num_key_value_heads"] * shape["head_dim"] * 4  # keys and values, fp32
    assert mtp.block_manager.num_blocks == 2**20 // per_block < plain.block_manager.num_blocks
