"""Prefill/decode disaggregation on the CPU: real servers on loopback, the orchestrator's view (`/v1/generate`).

Every server of the tiny Qwen3 runs `run.exact` (batch-invariant), so a token's numbers do not depend on which step
or batch computed it: a decode server continuing from a prefill server's KV must then give one colocated server's
tokens and logprobs bit for bit, whatever was batched where. The latent-cache families (GLM-5, DeepSeek-V3) run here
with and without exact mode: without, their pairs are held to bit for bit where the forwards are one server's, to
1e-5 elsewhere.
"""

from __future__ import annotations

import concurrent.futures
import gc
import json
import os
import signal
import socket
import sys
import weakref

import httpx
import pytest
from inference_helpers import make_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from local_servers import serving, tandem_inference  # noqa: E402

from tandem.config.inference import DisaggregationConfig, InferenceConfig  # noqa: E402
from tandem.config.resolve import free_port  # noqa: E402
from tandem.inference.disaggregated.peers import PeerUnreachable  # noqa: E402
from tandem.inference.disaggregated.shared_memory import SHM_DIR, area_path  # noqa: E402
from tandem.inference.disaggregated.wire import AreaAnswer  # noqa: E402
from tandem.inference.server import BackgroundServer  # noqa: E402
from tandem.launch.process import RunFailed  # noqa: E402
from tandem.models.presets import PRESETS, shape_config, write_model  # noqa: E402

THRESHOLD = 32
"""`min_remote_prefill_tokens` of the tests: prompts of 40+ new tokens go to the prefill server."""

STAGING_MIB = 0.01
"""`staging_mib` of the prefill servers: 10 KiB, where a 70-token prompt's blocks of the tiny model take 80 KiB, so
every `shared_memory` transfer crosses in several pieces through one reused area."""


def exact_config(model_dir, **disaggregation) -> InferenceConfig:
    config = make_config(model_dir)
    return config.model_copy(update={"run": config.run.model_copy(update={"exact": True}),
                                     "disaggregation": DisaggregationConfig.model_validate(disaggregation)})


@pytest.fixture(scope="module")
def colocated(tiny_dir):
    server = BackgroundServer(exact_config(tiny_dir))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prefill(tiny_dir):
    server = BackgroundServer(exact_config(tiny_dir, role="prefill", staging_mib=STAGING_MIB))
    yield server
    server.stop()


def decode_server(tiny_dir, prefill_url: str, kv_transport: str = "http", **settings) -> BackgroundServer:
    return BackgroundServer(exact_config(tiny_dir, role="decode", prefill_urls=[prefill_url], kv_transport=kv_transport,
                                         min_remote_prefill_tokens=THRESHOLD, forward_updates_to=[prefill_url],
                                         **settings))


def generate(url: str, prompt: list[int], seed: int, n: int = 1, max_tokens: int = 10) -> list[dict]:
    body = {"prompt_token_ids": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "n": n,
            "ignore_eos": True}
    response = httpx.post(f"{url}/v1/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return [{k: c[k] for k in ("token_ids", "logprobs", "weight_version")} for c in response.json()["choices"]]


def stats(url: str) -> dict[str, int]:
    return httpx.get(f"{url}/disaggregation/stats").json()


def prompt_of(i: int, length: int = 70) -> list[int]:
    return [(7 * i + 3 * j) % 250 + 1 for j in range(length)]


@pytest.mark.parametrize("kv_transport", ["http", "torch_distributed", "shared_memory"])
def test_a_disaggregated_pair_gives_one_servers_tokens_and_logprobs(tiny_dir, colocated, prefill, kv_transport):
    decode = decode_server(tiny_dir, prefill.url, kv_transport)
    try:
        for seed, n in ((1, 1), (2, 3)):
            prompt = prompt_of(seed)
            assert generate(decode.url, prompt, seed, n) == generate(colocated.url, prompt, seed, n)
        assert stats(decode.url) == {"num_prefills_handed": 2, "num_prefills_failed": 0, "num_prefilled_taken": 2,
                                     "num_prefilled_refused": 0, "num_prefill_busy_answers": 0}
    finally:
        decode.stop()


def test_a_lost_gloo_transfer_drops_the_pair_its_prompt_is_prefilled_here_and_a_new_pair_is_joined(tiny_dir, colocated):
    prefill = BackgroundServer(exact_config(tiny_dir, role="prefill"))
    decode = BackgroundServer(exact_config(tiny_dir, role="decode", prefill_urls=[prefill.url], peer_timeout_s=2,
                                           kv_transport="torch_distributed", min_remote_prefill_tokens=THRESHOLD,
                                           peer_retry_s=0))
    try:
        assert generate(decode.url, prompt_of(12), 12) == generate(colocated.url, prompt_of(12), 12)
        pairs = prefill.server.config.app.state.kv_pairs
        pairs.send = lambda request, tensors: None  # the send never comes: the prompt waits out its deadline
        assert generate(decode.url, prompt_of(13), 13) == generate(colocated.url, prompt_of(13), 13)
        assert stats(decode.url)["num_prefills_failed"] == 1
        del pairs.send  # sends work again: the next prompt joins a new pair and goes over it
        assert generate(decode.url, prompt_of(14), 14) == generate(colocated.url, prompt_of(14), 14)
        assert stats(decode.url) == {"num_prefills_handed": 2, "num_prefills_failed": 1, "num_prefilled_taken": 2,
                                     "num_prefilled_refused": 0, "num_prefill_busy_answers": 0}
        assert len(pairs.groups) == 2
    finally:
        decode.stop()
        prefill.stop()


def test_turns_go_to_the_prefill_server_only_with_many_new_tokens_and_match_one_server(tiny_dir, colocated, prefill):
    decode = decode_server(tiny_dir, prefill.url)
    try:
        conversation = prompt_of(5)
        for turn, num_new in enumerate((0, 8, 50)):  # the first prompt, a short turn (here), a long tool output (there)
            conversation = conversation + prompt_of(turn + 20, num_new)
            got, want = generate(decode.url, conversation, seed=turn), generate(colocated.url, conversation, seed=turn)
            assert got == want
            conversation = conversation + got[0]["token_ids"]
        assert stats(decode.url)["num_prefills_handed"] == 2  # the first prompt and the long turn
    finally:
        decode.stop()


def test_weight_updates_reach_both_pools_and_a_prefill_on_other_weights_is_redone(tiny_dir, tiny_other_dir, prefill):
    decode = decode_server(tiny_dir, prefill.url)
    other = BackgroundServer(exact_config(tiny_other_dir))
    try:
        # The decode server passes the update on: both pools serve policy 3, as one server of those weights.
        update = httpx.post(f"{decode.url}/update_weights", json={"path": str(tiny_other_dir), "version": 3}, timeout=60)
        assert update.json() == {"weight_version": 3}
        assert httpx.get(f"{prefill.url}/prefill/info").json()["weight_version"] == 3
        httpx.post(f"{other.url}/update_weights", json={"path": str(tiny_other_dir), "version": 3}, timeout=60)
        assert generate(decode.url, prompt_of(8), 8) == generate(other.url, prompt_of(8), 8)
        assert stats(decode.url)["num_prefills_handed"] == 1
        # The prefill server alone moves on: it refuses the decode server's version, which prefills the prompt itself.
        httpx.post(f"{prefill.url}/update_weights", json={"path": str(tiny_dir), "version": 4}, timeout=60)
        assert generate(decode.url, prompt_of(9), 9) == generate(other.url, prompt_of(9), 9)
        assert stats(decode.url)["num_prefills_failed"] == 1
    finally:
        httpx.post(f"{prefill.url}/update_weights", json={"path": str(tiny_dir), "version": 0}, timeout=60)
        decode.stop()
        other.stop()


def test_a_decode_server_reaches_prefill_servers_behind_the_api_key_both_pools_share(tiny_dir):
    key = {"api_key": "sk-pools"}
    prefill_config = exact_config(tiny_dir, role="prefill")
    prefill_config = prefill_config.model_copy(update={"server": prefill_config.server.model_copy(update=key)})
    locked_prefill = BackgroundServer(prefill_config)
    try:
        decode_config = exact_config(tiny_dir, role="decode", prefill_urls=[locked_prefill.url],
                                     min_remote_prefill_tokens=THRESHOLD)
        decode_config = decode_config.model_copy(update={"server": decode_config.server.model_copy(update=key)})
        decode = BackgroundServer(decode_config)
        try:
            body = {"prompt_token_ids": prompt_of(11), "max_tokens": 6, "seed": 11, "ignore_eos": True}
            response = httpx.post(f"{decode.url}/v1/generate", json=body, headers={"Authorization": "Bearer sk-pools"},
                                  timeout=60)
            assert response.status_code == 200, response.text
            handed = httpx.get(f"{decode.url}/disaggregation/stats", headers={"Authorization": "Bearer sk-pools"})
            assert handed.json()["num_prefills_handed"] == 1
            assert httpx.post(f"{locked_prefill.url}/prefill", json={"prompt_token_ids": [1], "weight_version": 0}
                              ).status_code == 401
        finally:
            decode.stop()
    finally:
        locked_prefill.stop()


@pytest.mark.parametrize("kv_transport", ["http", "shared_memory"])
def test_killing_the_prefill_server_mid_run_loses_no_request(tiny_dir, colocated, tmp_path, kv_transport):
    """Servers in processes of their own, as `tandem rl` runs them: `shared_memory` maps another process's area."""
    port = free_port()
    prefill_url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tandem.cli", "inference", "--model.name", str(tiny_dir), "--server.port", str(port),
            "--engine.device", "cpu", "--run.exact", "--disaggregation.role", "prefill",
            "--disaggregation.staging_mib", str(STAGING_MIB)]
    with serving("prefill", argv, prefill_url, tmp_path / "prefill.log") as prefill_proc, \
            tandem_inference(tiny_dir, tmp_path / "decode.log", "--run.exact", "--disaggregation.role", "decode",
                             "--disaggregation.kv_transport", kv_transport,
                             "--disaggregation.prefill_urls", json.dumps([prefill_url]),
                             "--disaggregation.min_remote_prefill_tokens", str(THRESHOLD),
                             "--disaggregation.peer_retry_s", "0") as (decode_url, _):
        prompts = [prompt_of(i, 60 + i) for i in range(12)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(generate, decode_url, p, i, 1, 24) for i, p in enumerate(prompts[:4])]
            futures[0].result()  # the prefill server has served; now it dies while requests run and keep coming
            os.killpg(prefill_proc.pid, signal.SIGKILL)
            futures += [pool.submit(generate, decode_url, p, i + 4, 1, 24) for i, p in enumerate(prompts[4:])]
            got = [f.result() for f in futures]
        counts = stats(decode_url)
    assert got == [generate(colocated.url, p, i, 1, 24) for i, p in enumerate(prompts)]
    assert counts["num_prefills_handed"] >= 1 and counts["num_prefills_failed"] >= 1


@pytest.mark.parametrize("kv_transport", ["http", "shared_memory"])
def test_exported_prompts_are_released_once_taken(tiny_dir, prefill, kv_transport):
    held = prefill.server.config.app.state.held_prefills
    exported, put = [], held.put
    held.put = lambda tensors: exported.append(weakref.ref(tensors[0])) or put(tensors)
    decode = decode_server(tiny_dir, prefill.url, kv_transport)
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda i: generate(decode.url, prompt_of(40 + i), i), range(6)))
        assert stats(decode.url)["num_prefills_handed"] == 6
    finally:
        decode.stop()
        del held.put
    gc.collect()
    assert len(exported) == 6 and not [ref for ref in exported if ref() is not None]
    assert len(held) == 0 and held.num_bytes == 0


def test_a_prompt_larger_than_the_held_budget_is_refused_for_good_and_prefilled_by_the_decode_server(tiny_dir, colocated):
    """A 70-token prompt's blocks take 80 KiB: a 64 KiB budget refuses every one (400), before any work."""
    prefill = BackgroundServer(exact_config(tiny_dir, role="prefill", max_held_mib=1 / 16))
    decode = decode_server(tiny_dir, prefill.url)
    try:
        for seed in (18, 19):  # the second still goes there: a refusal does not mark the prefill server down
            assert generate(decode.url, prompt_of(seed), seed) == generate(colocated.url, prompt_of(seed), seed)
        assert stats(decode.url) == {"num_prefills_handed": 0, "num_prefills_failed": 2, "num_prefilled_taken": 0,
                                     "num_prefilled_refused": 0, "num_prefill_busy_answers": 0}
        response = httpx.post(f"{prefill.url}/prefill", json={"prompt_token_ids": prompt_of(20), "weight_version": 0})
        assert response.status_code == 400
        assert "more than `disaggregation.max_held_mib` (0.1 MiB)" in response.json()["error"]["message"]
        assert prefill.served.engine.stats().num_prompt_tokens == 0  # nothing was computed there
    finally:
        decode.stop()
        prefill.stop()


def test_a_decode_server_waits_for_room_on_a_full_prefill_server_instead_of_prefilling_itself(tiny_dir, colocated):
    """A 100 KiB budget holds one 70-token prompt (80 KiB). One computed and never taken fills it (a second is
    refused, 429) until its hold times out; a decode server's prompt meanwhile is asked again until it fits, then
    handed over: nothing prefilled on the decode server."""
    prefill = BackgroundServer(exact_config(tiny_dir, role="prefill", max_held_mib=100 / 1024, hold_timeout_s=1.0))
    decode = decode_server(tiny_dir, prefill.url)
    try:
        held = prefill.server.config.app.state.held_prefills
        ask = {"prompt_token_ids": prompt_of(21), "weight_version": 0}
        assert httpx.post(f"{prefill.url}/prefill", json=ask, timeout=60).status_code == 200
        response = httpx.post(f"{prefill.url}/prefill", json=dict(ask, prompt_token_ids=prompt_of(22)))
        assert response.status_code == 429 and "`disaggregation.max_held_mib`" in response.json()["error"]["message"]
        assert len(held) == 1
        assert generate(decode.url, prompt_of(23), 23) == generate(colocated.url, prompt_of(23), 23)
        counts = stats(decode.url)
        assert counts.pop("num_prefill_busy_answers") >= 1
        assert counts == {"num_prefills_handed": 1, "num_prefills_failed": 0, "num_prefilled_taken": 1,
                          "num_prefilled_refused": 0}
        assert len(held) == 0  # the untaken one expired, which made room; the decode server's was taken
    finally:
        decode.stop()
        prefill.stop()


def test_a_decode_server_asks_for_no_more_prompts_than_its_received_budget_holds(tiny_dir, colocated, prefill):
    """A 100 KiB budget holds one 70-token prompt's blocks (80 KiB): of four requests at once, each is asked for only
    once the engine took the one before in, and all are handed over; a 64 KiB budget holds none, and the prompt is
    prefilled here without asking."""
    decode = decode_server(tiny_dir, prefill.url, max_received_mib=100 / 1024)
    remote = decode.served.remote_prefill
    asked, ask = [], remote.peers.prefill

    async def counted(*args):
        asked.append(remote.received_bytes)
        return await ask(*args)

    remote.peers.prefill = counted
    try:
        seeds = [24, 25, 26, 27]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda seed: generate(decode.url, prompt_of(seed), seed), seeds))
        assert got == [generate(colocated.url, prompt_of(seed), seed) for seed in seeds]
        assert asked == [80 * 1024] * 4  # each asked for alone: its own bytes, none of another's held
        assert stats(decode.url)["num_prefills_handed"] == 4 and remote.received_bytes == 0
    finally:
        decode.stop()
    decode = decode_server(tiny_dir, prefill.url, max_received_mib=1 / 16)
    try:
        assert generate(decode.url, prompt_of(28), 28) == generate(colocated.url, prompt_of(28), 28)
        assert stats(decode.url) == {"num_prefills_handed": 0, "num_prefills_failed": 0, "num_prefilled_taken": 0,
                                     "num_prefilled_refused": 0, "num_prefill_busy_answers": 0}
    finally:
        decode.stop()


def test_a_shared_memory_decode_server_fails_at_start_on_another_host_or_an_area_it_cannot_map(tiny_dir, prefill):
    areas = prefill.server.config.app.state.staging_areas
    try:
        areas.open = lambda request: AreaAnswer("elsewhere", 1024, file_name="0" * 32)
        with pytest.raises(PeerUnreachable, match=f"the prefill server {prefill.url} runs on host 'elsewhere', this "
                                                  "decode server on .*: `disaggregation.kv_transport` = 'shared_memory' "
                                                  "needs both on one host"):
            decode_server(tiny_dir, prefill.url, "shared_memory")
        areas.open = lambda request: AreaAnswer(socket.gethostname(), 1024, file_name="0" * 32)
        with pytest.raises(PeerUnreachable, match=f"cannot map the prefill server {prefill.url}'s KV staging area "
                                                  f"{area_path('0' * 32)}"):
            decode_server(tiny_dir, prefill.url, "shared_memory")
    finally:
        del areas.open
    assert not areas.areas  # what the refused decode servers asked for at first was never made


def test_a_shared_memory_transfer_that_fails_midway_maps_a_new_area_and_leaves_one_per_decode_server(tiny_dir, colocated):
    prefill = BackgroundServer(exact_config(tiny_dir, role="prefill", staging_mib=STAGING_MIB))
    decode = BackgroundServer(exact_config(tiny_dir, role="decode", prefill_urls=[prefill.url], peer_retry_s=0,
                                           kv_transport="shared_memory", min_remote_prefill_tokens=THRESHOLD))
    try:
        areas = prefill.server.config.app.state.staging_areas
        assert generate(decode.url, prompt_of(15), 15) == generate(colocated.url, prompt_of(15), 15)
        [first] = areas.areas.values()
        assert first.path is None and not list(SHM_DIR.glob("tandem-kv-*"))  # unlinked once mapped; held: none
        stage = areas.stage

        def lose_the_second_piece(request, transfer_id, tensors):
            if request.start > 0:
                raise RuntimeError("the second piece is lost")
            return stage(request, transfer_id, tensors)

        areas.stage = lose_the_second_piece
        assert generate(decode.url, prompt_of(16), 16) == generate(colocated.url, prompt_of(16), 16)
        assert stats(decode.url)["num_prefills_failed"] == 1
        del areas.stage
        assert generate(decode.url, prompt_of(17), 17) == generate(colocated.url, prompt_of(17), 17)
        assert stats(decode.url)["num_prefills_handed"] == 2
        [second] = areas.areas.values()  # the decode server's new area replaced its first
        assert second is not first
    finally:
        decode.stop()
        prefill.stop()
    assert not areas.areas  # the decode server had its area dropped as it stopped


def test_a_decode_server_that_cannot_reach_its_prefill_server_fails_naming_the_address(tiny_dir, tmp_path):
    missing = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RunFailed) as failed:
        with tandem_inference(tiny_dir, tmp_path / "decode.log", "--disaggregation.role", "decode",
                              "--disaggregation.prefill_urls", json.dumps([missing]),
                              "--disaggregation.peer_timeout_s", "1"):
            pass
    assert f"cannot reach the prefill server {missing} (`disaggregation.prefill_urls`)" in str(failed.value)


def test_a_decode_server_needs_prefill_servers_and_roles_need_tandems_engine(tiny_dir):
    with pytest.raises(ValueError, match=r"`role` = 'decode' needs `prefill_urls`"):
        DisaggregationConfig(role="decode")
    with pytest.raises(ValueError, match=r"`forward_updates_to` names \['http://b'\], which `prefill_urls` does not list"):
        DisaggregationConfig(role="decode", prefill_urls=["http://a"], forward_updates_to=["http://b"])
    with pytest.raises(ValueError, match=r"`disaggregation.role` = 'prefill' needs `backend` = 'tandem'"):
        InferenceConfig.model_validate({"model": {"name": str(tiny_dir)}, "disaggregation": {"role": "prefill"},
                                        "backend": "vllm"})


def test_a_transformers_model_is_refused_in_a_pool(tmp_path):
    """The transformers path recomputes every step from the tokens and keeps no cache: a prefill or decode server of
    such a model stops at start-up, naming why, instead of failing each prompt it would hand over."""
    from test_fallback import tiny_llama

    config = make_config(tiny_llama(tmp_path / "llama", seed=0), max_model_len=256)
    config = config.model_copy(update={"disaggregation": DisaggregationConfig(role="prefill")})
    with pytest.raises(ValueError, match="keeps no KV cache to hand over; serve it colocated"):
        BackgroundServer(config)


LATENT_SHAPES = {"tiny-glm5-sparse": dict(PRESETS["tiny-glm5"], index_topk=8), "tiny-deepseek-v3": PRESETS["tiny-deepseek-v3"]}
"""The latent-cache families: GLM-5 with a DSA top-k far below the prompts (70+ tokens), so each query attends to
the tokens its indexer chose over the handed indexer keys, and DeepSeek-V3 (latent entries only)."""


def latent_config(folder, engine: dict | None = None, **disaggregation) -> InferenceConfig:
    """`engine`: settings over `inference_helpers.ENGINE`'s."""
    config = make_config(folder, **(engine or {}))
    return config.model_copy(update={"disaggregation": DisaggregationConfig.model_validate(disaggregation)})


def assert_same_tokens_and_close_logprobs(got: list[dict], want: list[dict]) -> None:
    assert [c["token_ids"] for c in got] == [c["token_ids"] for c in want]
    assert [lp for c in got for lp in c["logprobs"]] == pytest.approx([lp for c in want for lp in c["logprobs"]], abs=1e-5)


@pytest.mark.parametrize("shape", LATENT_SHAPES)
def test_a_latent_cache_pair_gives_one_servers_tokens_and_logprobs_single_and_multi_turn(shape, tmp_path):
    """Without exact mode, the numbers agree bit for bit only where the decode server runs the
    forwards one server runs: a lone prompt handed over whole. Elsewhere the same tokens were computed in other
    batches (n > 1: the other samples' last partial block beside other work; a handed turn: the earlier turns'
    sampled tokens recomputed in the prefill server's chunk), which fp32 rounds differently in the last bits."""
    folder = write_model(shape_config(LATENT_SHAPES[shape]), tmp_path / shape)
    one = BackgroundServer(latent_config(folder))
    prefill = BackgroundServer(latent_config(folder, role="prefill"))
    decodes = [BackgroundServer(latent_config(folder, role="decode", prefill_urls=[prefill.url], kv_transport=transport,
                                              min_remote_prefill_tokens=THRESHOLD))
               for transport in ("http", "torch_distributed", "shared_memory")]
    try:
        for i, decode in enumerate(decodes):
            assert generate(decode.url, prompt_of(i), i) == generate(one.url, prompt_of(i), i)
            assert_same_tokens_and_close_logprobs(generate(decode.url, prompt_of(i + 2), i, n=3),
                                                  generate(one.url, prompt_of(i + 2), i, n=3))
        conversation = prompt_of(5)
        for turn, num_new in enumerate((0, 8, 50)):  # the first prompt and the long turn go to the prefill server
            conversation = conversation + prompt_of(turn + 20, num_new)
            got, want = generate(decodes[0].url, conversation, seed=turn), generate(one.url, conversation, seed=turn)
            if turn < 2:
                assert got == want
            assert_same_tokens_and_close_logprobs(got, want)
            conversation = conversation + got[0]["token_ids"]
        assert stats(decodes[0].url) == {"num_prefills_handed": 4, "num_prefills_failed": 0, "num_prefilled_taken": 4,
                                         "num_prefilled_refused": 0, "num_prefill_busy_answers": 0}
        assert [stats(decode.url)["num_prefilled_taken"] for decode in decodes[1:]] == [2, 2]
    finally:
        for server in (*decodes, prefill, one):
            server.stop()


@pytest.mark.parametrize("shape", LATENT_SHAPES)
def test_an_exact_latent_cache_pair_gives_one_servers_tokens_and_logprobs_bit_for_bit(shape, tmp_path):
    """In exact mode each token is attended alone over exactly its context's latent entries (and, under DSA, its
    own choice among the handed indexer keys): where the default pair above is held to 1e-5 past a lone prompt,
    every sample and every turn is one server's to the last bit, whichever server computed its context."""
    folder = write_model(shape_config(LATENT_SHAPES[shape]), tmp_path / shape)
    one = BackgroundServer(exact_config(folder))
    prefill = BackgroundServer(exact_config(folder, role="prefill"))
    decode = BackgroundServer(exact_config(folder, role="decode", prefill_urls=[prefill.url],
                                           min_remote_prefill_tokens=THRESHOLD))
    try:
        assert generate(decode.url, prompt_of(1), 1, n=3) == generate(one.url, prompt_of(1), 1, n=3)
        conversation = prompt_of(5)
        for turn, num_new in enumerate((0, 8, 50)):  # the first prompt and the long turn go to the prefill server
            conversation = conversation + prompt_of(turn + 20, num_new)
            got = generate(decode.url, conversation, seed=turn)
            assert got == generate(one.url, conversation, seed=turn)
            conversation = conversation + got[0]["token_ids"]
        assert stats(decode.url) == {"num_prefills_handed": 3, "num_prefills_failed": 0, "num_prefilled_taken": 3,
                                     "num_prefilled_refused": 0, "num_prefill_busy_answers": 0}
    finally:
        for server in (decode, prefill, one):
            server.stop()


def test_a_decode_server_refuses_a_prefill_server_whose_blocks_hold_another_layout(tmp_path):
    folder = write_model(shape_config(LATENT_SHAPES["tiny-glm5-sparse"]), tmp_path / "glm5")
    prefill_config = latent_config(folder, role="prefill")
    prefill_config = prefill_config.model_copy(update={"model": prefill_config.model.model_copy(update={"dtype": "bfloat16"})})
    prefill = BackgroundServer(prefill_config)
    try:
        with pytest.raises(PeerUnreachable, match=r"keeps KV blocks of latent entries of 48 in each of 4 layers, DSA "
                                                  r"indexer keys of 32 in layers \[0, 2\], bfloat16; this decode server "
                                                  r"keeps .*, float32"):
            BackgroundServer(latent_config(folder, role="decode", prefill_urls=[prefill.url], peer_timeout_s=5))
    finally:
        prefill.stop()


def test_fp8_latent_blocks_hand_over_as_held_and_a_cache_of_another_dtype_refuses_them(tmp_path):
    """`engine.kv_cache_dtype = "fp8"` on both sides: the prompt's FP8 latent blocks (FP8 bytes and their scales, the
    RoPE parts, FP8 indexer keys) land in the decode server's cache as they were held, so that a lone prompt handed
    over whole gives one FP8 server's tokens and logprobs bit for bit. A decode server whose latent cache holds the
    model's dtype refuses the FP8 prefill server at start-up, naming both layouts."""
    folder = write_model(shape_config(LATENT_SHAPES["tiny-glm5-sparse"]), tmp_path / "glm5")
    fp8 = {"kv_cache_dtype": "fp8"}
    one = BackgroundServer(latent_config(folder, fp8))
    prefill = BackgroundServer(latent_config(folder, fp8, role="prefill"))
    decode = BackgroundServer(latent_config(folder, fp8, role="decode", prefill_urls=[prefill.url],
                                            min_remote_prefill_tokens=THRESHOLD))
    try:
        for i in range(2):
            assert generate(decode.url, prompt_of(i), i) == generate(one.url, prompt_of(i), i)
        assert stats(decode.url)["num_prefilled_taken"] == 2
        with pytest.raises(PeerUnreachable, match=r"keeps KV blocks of latent entries of 48 in each of 4 layers, DSA "
                                                  r"indexer keys of 32 in layers \[0, 2\], FP8 latent parts and "
                                                  r"indexer keys with an fp32 scale per token, RoPE parts of 16 in "
                                                  r"float32; this decode server keeps .*, float32"):
            BackgroundServer(latent_config(folder, role="decode", prefill_urls=[prefill.url], peer_timeout_s=5))
    finally:
        for server in (decode, prefill, one):
            server.stop()
