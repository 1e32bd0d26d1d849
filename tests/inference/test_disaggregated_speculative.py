"""Speculative decoding with prefill/decode disaggregation on the CPU: real servers on loopback, the orchestrator's
view (`/v1/generate`).

Every server runs `run.exact` (batch-invariant), so deterministic drafts change no token or logprob, whatever was
batched where: a speculating decode server and its prefill server give one colocated server's tokens and logprobs
bit for bit, with the same speculation or none, and, for drafts computed alike in any batch (n-gram, MTP), its
drafted and accepted counts.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from inference_helpers import make_config
from test_admin import metric
from test_disaggregated import THRESHOLD, stats
from test_mtp_draft import counting_dir, counting_head_dir, counting_mtp_dir, head_dir  # noqa: F401 (fixtures)

from tandem.config.inference import DisaggregationConfig, InferenceConfig
from tandem.inference.disaggregated.peers import PeerUnreachable
from tandem.inference.server import BackgroundServer

SPECULATIVE = {
    "ngram": {"method": "ngram", "num_tokens": 3, "min_expected_tokens": 0},
    "draft_model": {"method": "draft_model", "num_tokens": 3},  # drafted by the policy's own weights: often right
    "mtp": {"method": "mtp", "num_tokens": 3},
    "mtp-head": {"method": "mtp", "num_tokens": 3},  # a Qwen3 draft head: its keys and values travel in the blocks
}


def server_config(folder, speculative: dict, **disaggregation) -> InferenceConfig:
    config = make_config(folder, speculative=speculative)
    return config.model_copy(update={"run": config.run.model_copy(update={"exact": True}),
                                     "disaggregation": DisaggregationConfig.model_validate(disaggregation)})


def prompt_of(i: int) -> list[int]:
    """70 tokens that count up twice: handed over (past `THRESHOLD`), and a counting head goes on counting, so
    prompt lookup and the drafts of the policy's own weights are right."""
    return list(range(20 + i, 60 + i)) + list(range(20 + i, 50 + i))


def generate(url: str, prompt: list[int], seed: int, n: int, temperature: float) -> dict:
    body = {"prompt_token_ids": prompt, "max_tokens": 16, "temperature": temperature, "seed": seed, "n": n,
            "ignore_eos": True}
    response = httpx.post(f"{url}/v1/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    answer = response.json()
    return {"choices": [{k: c[k] for k in ("token_ids", "logprobs")} for c in answer["choices"]],
            "drafts": answer["usage"].get("completion_tokens_details")}


REQUESTS = [(0, 1, 0.0), (1, 3, 1.0), (2, 1, 0.7), (3, 2, 1.0)]
"""(seed, n, temperature) of each request, sent at once: prompts handed over while others verify drafts."""


def answers(url: str) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(lambda r: generate(url, prompt_of(r[0]), *r), REQUESTS))


def accepted(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, "tandem_spec_decode_accepted_tokens_total")


@pytest.mark.parametrize("method", SPECULATIVE)
def test_a_speculating_decode_server_gives_one_servers_tokens_logprobs_and_drafts(method, sharp_dir, counting_mtp_dir,
                                                                                   counting_head_dir):
    """The pair speculates with the colocated server's method (MTP on tiny GLM-5 with one MTP layer, or on the tiny
    Qwen3 with a draft head, the others on the tiny Qwen3), all under a counting head. Its answers are the colocated server's to the last bit, and for
    the n-gram and MTP drafts (computed alike in any batch) their drafted and accepted counts too (so the decode
    server's drafts for a handed prompt, MTP's from the handed layer entries and hidden state, are one server's:
    acceptance no worse), and a server's without speculation but for those counts; the decode server accepted
    drafts."""
    folder = {"mtp": counting_mtp_dir, "mtp-head": counting_head_dir}.get(method, sharp_dir)
    speculative = dict(SPECULATIVE[method], **({"draft_model": str(sharp_dir)} if method == "draft_model" else {}))
    prefill = BackgroundServer(server_config(folder, speculative, role="prefill"))
    servers = [prefill]
    try:
        decode = BackgroundServer(server_config(folder, speculative, role="decode", prefill_urls=[prefill.url],
                                                min_remote_prefill_tokens=THRESHOLD))
        servers.append(decode)
        got = answers(decode.url)
        assert stats(decode.url)["num_prefilled_taken"] == len(REQUESTS)
        assert accepted(decode.url) > 0
        colocated = BackgroundServer(server_config(folder, speculative))
        servers.append(colocated)
        want = answers(colocated.url)
        assert [a["choices"] for a in got] == [a["choices"] for a in want]
        if method != "draft_model":  # the draft model is not batch-invariant: its drafts may follow the batching
            assert [a["drafts"] for a in got] == [a["drafts"] for a in want]
        plain = BackgroundServer(server_config(folder, {}))
        servers.append(plain)
        assert [a["choices"] for a in got] == [a["choices"] for a in answers(plain.url)]
    finally:
        for server in servers:
            server.stop()


def test_an_mtp_decode_server_refuses_a_prefill_server_whose_blocks_lack_the_layers_entries(counting_mtp_dir):
    """Without `engine.speculative.method` = 'mtp' a prefill server's latent blocks hold no entries of the MTP layer,
    which the decode server's drafts attend over: it stops at start-up, naming the key."""
    prefill = BackgroundServer(server_config(counting_mtp_dir, {}, role="prefill"))
    try:
        with pytest.raises(PeerUnreachable, match=r"keeps KV blocks of latent entries of \d+ in each of 4 layers.*; "
                                                  r"this decode server keeps latent entries of \d+ in each of 5 layers"
                                                  r".*`engine\.speculative\.method` = 'mtp'"):
            BackgroundServer(server_config(counting_mtp_dir, SPECULATIVE["mtp"], role="decode",
                                           prefill_urls=[prefill.url], peer_timeout_s=5))
    finally:
        prefill.stop()
