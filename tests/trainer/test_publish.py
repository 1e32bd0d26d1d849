"""Publishing in the background: one write at a time, errors raised in the trainer, and a state that the
next optimizer step cannot change while it is written."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tandem.trainer.model import gather_full_state
from tandem.trainer.publish import BackgroundWriter


def test_writes_run_one_at_a_time_in_order():
    writer, done, started = BackgroundWriter(), [], threading.Event()

    def slow():
        started.set()
        time.sleep(0.2)
        done.append("first")

    writer.submit(slow)
    started.wait(5)
    assert done == []  # submit returned while the write runs
    writer.submit(lambda: done.append("second"))  # waits for the first
    assert done[0] == "first"
    writer.wait()
    assert done == ["first", "second"]


def test_a_failed_write_is_raised_by_the_next_call():
    writer = BackgroundWriter()

    def fail():
        raise OSError("No space left on device")

    writer.submit(fail)
    with pytest.raises(RuntimeError, match="writing a published weights folder failed: No space left") as info:
        writer.wait()
    assert isinstance(info.value.__cause__, OSError)
    writer.wait()  # reported once
    writer.submit(fail)
    with pytest.raises(RuntimeError):
        writer.submit(lambda: None)


class TwoParameters:
    """What `gather_full_state` reads of a policy: the HF-named parameters it publishes."""

    def __init__(self):
        self.params = {"model.norm.weight": torch.nn.Parameter(torch.ones(4)),
                       "lm_head.weight": torch.nn.Parameter(torch.arange(8.0).view(2, 4))}
        self.lm = torch.nn.Module()  # no router to publish in fp32

    def published_parameters(self):
        return iter(self.params.items())


def test_the_gathered_state_is_a_copy_even_in_the_parameters_dtype_and_device():
    policy = TwoParameters()
    state = gather_full_state(policy, torch.float32, keep=True)
    with torch.no_grad():
        for p in policy.params.values():
            p.add_(1.0)  # what the next optimizer step does while the write may still run
    assert state["model.norm.weight"].tolist() == [1.0] * 4
    assert state["lm_head.weight"].flatten().tolist() == [float(i) for i in range(8)]
    assert gather_full_state(policy, torch.float32, keep=False) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_state_published_in_bf16_is_rounded_as_on_the_host():
    """The conversion moves to the GPU (before the copy to the host): it must round as the host's does."""
    policy = TwoParameters()
    generator = torch.Generator().manual_seed(0)
    policy.params = {name: torch.nn.Parameter(torch.randn(1024, 257, generator=generator).cuda()) for name in policy.params}
    state = gather_full_state(policy, torch.bfloat16, keep=True)
    for name, param in policy.params.items():
        assert state[name].device.type == "cpu" and state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], param.detach().cpu().to(torch.bfloat16)), name
