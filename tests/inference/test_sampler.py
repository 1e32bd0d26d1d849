"""The sampler: what it may draw, and which logprob it reports."""

import torch

from tandem.inference.engine.sampler import Sampler, filter_logits
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.sequence import Sequence
from tandem.models.byte_tokenizer import build_byte_tokenizer

TOKENIZER = build_byte_tokenizer()
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def seqs(count: int, **params) -> list[Sequence]:
    out = []
    for i in range(count):
        p = SamplingParams(max_tokens=1, **params)
        gen = torch.Generator().manual_seed(p.seed + i) if p.seed is not None else None
        out.append(Sequence("r", i, [0], p, TOKENIZER, gen))
    return out


def draws(params: dict, num: int = 4000) -> torch.Tensor:
    sampler = Sampler(torch.device("cpu"), seed=0)
    result = sampler.sample(LOGITS.repeat(num, 1), seqs(num, **params)).result()
    return torch.tensor(result.token_ids)


def test_reported_logprob_is_the_temperature_scaled_full_distribution():
    sampler = Sampler(torch.device("cpu"), seed=0)
    for params in ({"temperature": 0.7}, {"temperature": 0.7, "top_k": 2}, {"temperature": 1.3, "top_p": 0.5, "min_p": 0.1}):
        result = sampler.sample(LOGITS.repeat(8, 1), seqs(8, **params)).result()
        full = (LOGITS[0] / params["temperature"]).log_softmax(-1)
        assert result.logprobs == full[result.token_ids].tolist()


def test_greedy_takes_the_argmax_and_reports_the_t1_logprob():
    result = Sampler(torch.device("cpu"), seed=0).sample(LOGITS, seqs(1, temperature=0.0)).result()
    assert result.token_ids == [0]
    assert result.logprobs[0] == LOGITS[0].log_softmax(-1)[0].item()


def test_draws_follow_the_distribution():
    counts = torch.bincount(draws({"temperature": 1.0}), minlength=6).float() / 4000
    expected = LOGITS[0].softmax(-1)
    assert (counts - expected).abs().max() < 0.03


def test_top_k_top_p_min_p_restrict_what_can_be_drawn():
    assert set(draws({"top_k": 2}).tolist()) == {0, 1}
    probs = LOGITS[0].softmax(-1)  # 0.61, 0.22, 0.14, ...: top_p 0.7 keeps the first two
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert set(draws({"top_p": 0.7}).tolist()) == {0, 1}
    assert set(draws({"min_p": 0.3}).tolist()) == {0, 1}  # 0.22 / 0.61 > 0.3 > 0.14 / 0.61


def test_filters_keep_the_top_token_even_at_the_smallest_settings():
    out = filter_logits(LOGITS, [1], [1e-6], [1.0])
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False, False, False]


def test_seeded_sequences_draw_the_same_tokens_in_any_batch():
    alone_seq, batched_seq = seqs(1, seed=9), seqs(1, seed=9)
    alone_sampler, batch_sampler = Sampler(torch.device("cpu"), seed=0), Sampler(torch.device("cpu"), seed=123)
    alone = [alone_sampler.sample(LOGITS, alone_seq).result().token_ids[0] for _ in range(30)]
    together = [batch_sampler.sample(LOGITS.repeat(3, 1), batched_seq + seqs(2)).result().token_ids[0] for _ in range(30)]
    assert alone == together and len(set(alone)) > 1


def test_top_logprobs_are_the_most_likely_tokens():
    result = Sampler(torch.device("cpu"), seed=0).sample(LOGITS, seqs(1, num_top_logprobs=3)).result()
    full = LOGITS[0].log_softmax(-1)
    assert result.top_logprobs[0] == ((0, full[0].item()), (1, full[1].item()), (2, full[2].item()))
