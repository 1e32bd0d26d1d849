"""A decode server's side of a hand-off on CUDA, and its step records there: taking handed-over KV blocks into the
cache (and a prefill server's export of them) queues its copies without waiting for the steps already queued on
the device, so a step in flight keeps running while the next is planned; the engine writes them on a stream of its
own, beside the next step, and changes no token or logprob doing so; the records time each step on the device from
CUDA events, read once they have completed."""

from __future__ import annotations

import pytest
import torch

from test_prefilled import prefill_on

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.kv_cache import KVCache
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_blocks_move_in_and_out_of_a_cuda_cache_without_waiting_for_the_device(fp8):
    source, target = (KVCache(2, 8, 16, 2, 64, torch.bfloat16, torch.device("cuda"), fp8=fp8) for _ in range(2))
    generator = torch.Generator(device="cuda").manual_seed(0)
    for held in (source.keys, source.values, source.key_scales, source.value_scales):
        if held is not None:  # any bytes: they are moved, never computed with
            held.view(torch.uint8).copy_(torch.randint(0, 256, held.view(torch.uint8).shape, dtype=torch.uint8,
                                                       device="cuda", generator=generator))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a copy that made the host wait for the stream would raise here
    try:
        blocks = source.export_blocks([1, 4, 6])
        target.import_blocks([5, 0, 2], blocks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for moved, held in ((target.keys, source.keys), (target.values, source.values), (target.key_scales, source.key_scales)):
        if held is not None:
            assert torch.equal(moved[:, [5, 0, 2]].view(torch.uint8), held[:, [1, 4, 6]].view(torch.uint8))


def cuda_engine(tiny_dir, **settings):
    """fp32 on CUDA with graphs and overlapped steps, a small cache (so freed blocks are soon taken again)."""
    config = {"device": "cuda", "max_num_seqs": 8, "max_model_len": 512, "max_num_batched_tokens": 512,
              "num_blocks": 64, **settings}
    return build_engine(ModelConfig(name=str(tiny_dir), dtype="float32"), EngineConfig(**config), seed=0)


def decode_with_hand_offs(tiny_dir, handed: list, import_beside: bool) -> dict:
    """Four requests decode, finishing at different steps; three handed-over prompts join at steps 2, 3 and 5, the
    second with n = 2 (its other sample shares the imported blocks in the step it joins). Per sequence: its tokens
    and logprobs."""
    engine = cuda_engine(tiny_dir)
    assert engine.import_stream is not None
    if not import_beside:
        engine.import_stream = None  # each import on the engine's stream, ahead of the next step
    for i in range(4):
        engine.add_request(f"d{i}", [i + 5] * 30, SamplingParams(max_tokens=6 + 4 * i, temperature=1.0, seed=i,
                                                                 ignore_eos=True))
    joins = {2: (0, 1), 3: (1, 2), 5: (2, 1)}
    results, step = {}, 0
    while engine.has_unfinished or step <= max(joins):
        step += 1
        if step in joins:
            k, n = joins[step]
            engine.add_prefilled(f"h{k}", handed[k][0], SamplingParams(max_tokens=8, temperature=1.0, seed=10 + k,
                                                                        ignore_eos=True), n, True, handed[k][1])
        for out in engine.step():
            entry = results.setdefault((out.request_id, out.index), ([], []))
            entry[0].extend(out.token_ids)
            entry[1].extend(out.logprobs)
    assert engine.num_prefilled_taken == 3
    return results


def test_handed_over_blocks_written_beside_the_next_step_change_no_token(tiny_dir):
    prefill = cuda_engine(tiny_dir)
    prompts = [[(7 * k + 3 * j) % 250 + 1 for j in range(150 + 20 * k)] for k in range(3)]
    handed = [(prompt, prefill_on(prefill, prompt)) for prompt in prompts]
    beside = decode_with_hand_offs(tiny_dir, handed, import_beside=True)
    ahead = decode_with_hand_offs(tiny_dir, handed, import_beside=False)
    assert len(beside) == 8 and beside == ahead  # four decoding, four handed over (one request of n = 2)


def test_step_records_time_each_step_on_the_device(tiny_dir):
    engine = build_engine(ModelConfig(name=str(tiny_dir), dtype="float32"),
                          EngineConfig(device="cuda", max_num_seqs=8, max_model_len=256, max_num_batched_tokens=256,
                                       num_step_records=100), seed=0)
    assert engine.overlap and engine.runner.graphs is not None
    for i in range(4):
        engine.add_request(str(i), [i + 3] * (20 + i), SamplingParams(max_tokens=12, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    torch.cuda.synchronize()
    steps = engine.step_records.snapshot()
    launched = [s["launched"] for s in steps if s["launched"] is not None]
    assert len(launched) == 12 and all(s["busy"] is not None for s in launched)
    # One stream: each call's device work starts once the last one's is done.
    for earlier, later in zip(launched, launched[1:]):
        assert earlier["busy"][0] <= earlier["busy"][1] <= later["busy"][0] + 1e-4
    assert [s["graph"] for s in launched] == [False] + [True] * 11  # the prompts' step, then decode graphs
    assert all(later["read"] == earlier["launched"] for earlier, later in zip(steps, steps[1:]))  # overlapped
