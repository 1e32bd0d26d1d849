"""The broadcast weight transport over a real gloo group: a trainer process, real servers on loopback.

The orchestrator's side is its real code (`BroadcastPolicies` over an `InferencePool`), the
trainer's is `WeightBroadcaster` in its own process: what the servers then sample must equal what a
folder reload of the same weights gives, token for token and logprob for logprob.
"""

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from inference_helpers import QUANTIZED, make_config

from tandem.config.orchestrator import ClientConfig
from tandem.config.resolve import free_port
from tandem.config.weight_transport import BroadcastWeightTransport
from tandem.inference.server import BackgroundServer
from tandem.kernels.fp8 import FP8
from tandem.models.fp8 import fp8_weight_names, quantize_named
from tandem.models.hub import read_hf_config
from tandem.models.loading import build_native
from tandem.models.presets import init_model
from tandem.models.weights import load_state_dict
from tandem.orchestrator.inference_pool import InferencePool, InferenceRequestError
from tandem.orchestrator.policy_source import BroadcastPolicies

TRAINER = Path(__file__).with_name("broadcast_trainer.py")
BODIES = [{"prompt_token_ids": [3, 14, 15, 92, 65], "max_tokens": 24, "seed": 7, "temperature": 1.0, "ignore_eos": True},
          {"prompt_token_ids": [2, 71, 82], "max_tokens": 24, "seed": 8, "temperature": 0.7, "ignore_eos": True}]


def sample(url: str) -> list[tuple[list[int], list[float], int]]:
    out = []
    for body in BODIES:
        choice = httpx.post(f"{url}/v1/generate", json=body, timeout=60).json()["choices"][0]
        out.append((choice["token_ids"], choice["logprobs"], choice["weight_version"]))
    return out


@pytest.fixture
def two_servers(tiny_dir):
    servers = [BackgroundServer(make_config(tiny_dir)) for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


def broadcast(run_dir: Path, servers: list[BackgroundServer], folder: Path, step: int, *options: str) -> str:
    """Trainer process and orchestrator code meet in a real gloo group; policy `step` = `folder`'s weights.
    `options`: the trainer script's (`--fp8`). Returns the trainer's output."""
    port = free_port()
    config = BroadcastWeightTransport(port=port, num_inference_ranks=len(servers))
    trainer = subprocess.Popen([sys.executable, str(TRAINER), *options, str(run_dir), str(port), str(len(servers)), str(step),
                                str(folder)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    source = BroadcastPolicies(run_dir, config)

    async def orchestrate():
        pool = InferencePool(ClientConfig(base_urls=[s.url for s in servers], timeout_s=60))
        try:
            await source.setup(pool)
            while source.next_version(0) != step:
                assert trainer.poll() is None, trainer.stdout.read()
                await asyncio.sleep(0.05)
            await source.load(pool, step)
        finally:
            await pool.aclose()

    try:
        asyncio.run(orchestrate())
        output, _ = trainer.communicate(timeout=60)
    finally:
        trainer.kill()
    assert trainer.returncode == 0 and "sent" in output, output
    return output


def test_broadcast_serves_what_a_folder_reload_serves(two_servers, tiny_dir, tiny_other_dir, tmp_path):
    before = sample(two_servers[0].url)
    broadcast(tmp_path, two_servers, tiny_other_dir, step=3)

    reloaded = BackgroundServer(make_config(tiny_dir))
    try:
        response = httpx.post(f"{reloaded.url}/update_weights", json={"path": str(tiny_other_dir), "version": 3}, timeout=60)
        assert response.status_code == 200, response.text
        expected = sample(reloaded.url)
    finally:
        reloaded.stop()
    assert [v for _, _, v in expected] == [3, 3]
    for server in two_servers:
        assert sample(server.url) == expected
        assert httpx.get(f"{server.url}/weight_info").json() == {"weight_version": 3}
    assert before != expected  # the other weights sample otherwise: the broadcast changed something


def quantized_broadcast(start: Path, policy: Path, run_dir: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """An FP8 engine over `start` takes `policy` by a quantized broadcast (`weight_transport.quantization = "fp8"`),
    another by a folder reload: both hold the same tensors, bit for bit, and sample alike. Returns the trainer's
    output and the weights the engine holds."""
    receiver, reloaded = (BackgroundServer(make_config(start, quantization="fp8")) for _ in range(2))
    try:
        output = broadcast(run_dir, [receiver], policy, 3, "--fp8")
        response = httpx.post(f"{reloaded.url}/update_weights", json={"path": str(policy), "version": 3}, timeout=60)
        assert response.status_code == 200, response.text
        got, expected = (server.served.engine.engine.weight_target.state_dict() for server in (receiver, reloaded))
        assert got.keys() == expected.keys()
        for name, tensor in got.items():
            bits = (lambda t: t.view(torch.uint8)) if tensor.dtype == FP8 else (lambda t: t)
            assert tensor.dtype == expected[name].dtype and torch.equal(bits(tensor), bits(expected[name])), name
        assert sample(receiver.url) == sample(reloaded.url)
    finally:
        receiver.stop()
        reloaded.stop()
    return output, got


def test_an_fp8_engine_takes_the_trainers_quantized_projections_as_they_are(tiny_dir, tiny_other_dir, tmp_path):
    """`weight_transport.quantization = "fp8"`: the trainer sends the projections in FP8 blocks with their scales, and
    the engine holds, bit for bit, what it holds after quantizing the same bf16 weights itself (a folder reload),
    for the bytes of FP8 and scales in place of bf16."""
    output, got = quantized_broadcast(tiny_dir, tiny_other_dir, tmp_path)
    assert sum(t.dtype == FP8 for t in got.values()) == 14  # 7 projections x 2 layers
    state = load_state_dict(tiny_other_dir)
    fp8_bytes = sum(t.numel() + 4 * -(-t.shape[0] // 128) * -(-t.shape[1] // 128) for n, t in state.items() if QUANTIZED.fullmatch(n))
    other_bytes = sum(t.numel() * t.itemsize for n, t in state.items() if not QUANTIZED.fullmatch(n))
    assert f"step 3: {fp8_bytes + other_bytes} bytes" in output, output
    bf16_bytes = sum(2 * t.numel() for n, t in state.items() if QUANTIZED.fullmatch(n))
    assert fp8_bytes < 0.6 * bf16_bytes


def test_an_fp8_latent_engine_takes_the_trainers_quantized_weights_as_they_are(tmp_path):
    """The same for GLM-5's latent blocks: MLA's and the indexer's FP8 projections, the feed-forwards' and the routed
    experts' cross the group quantized, kv_b_proj in the model's dtype. The trainer sends the multi-token prediction
    layer too (quantized likewise), which an engine that does not draft with it holds not and passes over."""
    start, policy = (init_model("tiny-glm5", tmp_path / f"glm5-{seed}", seed=seed) for seed in (0, 1))
    output, got = quantized_broadcast(start, policy, tmp_path / "run")
    fp8 = {name for name, t in got.items() if t.dtype == FP8}
    assert "model.layers.1.self_attn.q_b_proj.weight" in fp8 and "model.layers.1.mlp.experts.gate_up_proj" in fp8
    assert "model.layers.0.self_attn.indexer.wk.weight" in fp8
    assert not any(".kv_b_proj." in name for name in fp8)
    names = fp8_weight_names(build_native(read_hf_config(policy), "meta", torch.bfloat16), experts=True)
    sent = dict(quantize_named(load_state_dict(policy).items(), names))
    assert sent["model.mtp_layers.0.mlp.experts.down_proj"].dtype == FP8
    assert f"step 3: {sum(t.numel() * t.itemsize for t in sent.values())} bytes" in output, output
    assert not any(name.startswith("model.mtp_layers.") for name in got)


def test_out_of_order_calls_are_conflicts(server):
    for path, body in (("/start_weight_update", {}), ("/finish_weight_update", {"weight_version": "1"}),
                       ("/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": []}})):
        response = httpx.post(f"{server.url}{path}", json=body, timeout=10)
        assert response.status_code == 409, (path, response.text)
        assert "weight" in response.json()["error"]["message"]


def test_bad_init_info_is_a_400_naming_it(server):
    response = httpx.post(f"{server.url}/init_weight_transfer_engine",
                          json={"init_info": {"master_address": "127.0.0.1", "master_port": "x"}}, timeout=10)
    assert response.status_code == 400 and "init_info" in response.json()["error"]["message"]
    info = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2}

    async def init():
        pool = InferencePool(ClientConfig(base_urls=[server.url]))
        try:
            await pool.init_weight_transfer([info])
        finally:
            await pool.aclose()

    with pytest.raises(InferenceRequestError, match="rank_offset"):
        asyncio.run(init())


@pytest.mark.slow
def test_policies_announced_back_to_back_are_received_in_turn(two_servers, tiny_dir, tiny_other_dir, tmp_path):
    """The trainer sends policies 1 and 2 without waiting for the servers (the transport may buffer
    them); the orchestrator takes 1, then 2, never skipping one that is already in the group."""
    expected = sample(two_servers[0].url)
    port = free_port()
    config = BroadcastWeightTransport(port=port, num_inference_ranks=2)
    trainer = subprocess.Popen([sys.executable, str(TRAINER), str(tmp_path), str(port), "2", "1", str(tiny_other_dir),
                                "2", str(tiny_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    source = BroadcastPolicies(tmp_path, config)

    async def orchestrate() -> list[int]:
        pool = InferencePool(ClientConfig(base_urls=[s.url for s in two_servers], timeout_s=60))
        loaded = [0]
        try:
            await source.setup(pool)
            while loaded[-1] < 2:
                assert trainer.poll() in (None, 0), trainer.stdout.read()
                version = source.next_version(loaded[-1])
                if version is None:
                    await asyncio.sleep(0.02)
                    continue
                await source.load(pool, version)
                loaded.append(version)
        finally:
            await pool.aclose()
        return loaded

    try:
        loaded = asyncio.run(orchestrate())
        output, _ = trainer.communicate(timeout=60)
    finally:
        trainer.kill()
    assert trainer.returncode == 0, output
    assert loaded == [0, 1, 2] and source.next_version(0) is None  # loaded announcements are gone
    for server in two_servers:
        assert sample(server.url) == [(ids, lps, 2) for ids, lps, _ in expected]
