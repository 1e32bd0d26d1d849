"""The trainer's block forward computes the model's blocks (dense and mixture-of-experts): values and
gradients, with and without selective recompute, eager and traced by `torch.compile`, one graph for
every layer and length."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from tandem.models.attention import DocumentCausalAttention
from tandem.models.loading import load_causal_lm
from tandem.trainer import dynamic_compile
from tandem.trainer.block import apply_training_blocks

BACKENDS = ["cudnn", "flash", "efficient", "math"]


@pytest.fixture
def traced(monkeypatch):
    """`torch.compile` with the `aot_eager` backend: Dynamo and AOTAutograd as on a GPU, no code generation."""
    monkeypatch.setattr(dynamic_compile, "BACKEND", "aot_eager")
    dynamic_compile.compiled.cache_clear()
    torch._dynamo.reset()
    counters.clear()
    yield
    dynamic_compile.compiled.cache_clear()
    torch._dynamo.reset()


def fp64_model(folder):
    return load_causal_lm(str(folder), "cpu", "float32").double().train()


def forward_backward(model, ids, lengths, attention=None):
    model.zero_grad(set_to_none=True)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    out = model(ids, positions, attention=attention)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("folder", ["tiny_model", "tiny_moe_model", "tiny_minimax_model"])
@pytest.mark.parametrize("compile, recompute", [(False, False), (False, True), (True, True)])
def test_training_blocks_compute_the_model(folder, recompute, compile, traced, request):
    """Dense blocks compile their feed-forward into the second half; sparse ones run it eagerly after it."""
    reference = fp64_model(request.getfixturevalue(folder))
    trained = copy.deepcopy(reference)
    apply_training_blocks(trained.layers, compile=compile, recompute=recompute)
    lengths = [11, 5, 8]
    ids = torch.randint(0, 260, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    ref_out, ref_grads = forward_backward(reference, ids, lengths)
    attention = DocumentCausalAttention([lengths], torch.device("cpu"), BACKENDS)
    out, grads = forward_backward(trained, ids, lengths, attention)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["tiny_model", "tiny_moe_model"])
def test_one_compiled_graph_per_half_serves_every_layer_and_length(folder, traced, request):
    """Dense: before and after attention; sparse: before attention and the attention residual."""
    model = fp64_model(request.getfixturevalue(folder))
    apply_training_blocks(model.layers, compile=True, recompute=True)
    for lengths in ([20], [9, 4]):
        ids = torch.randint(0, 260, (1, sum(lengths)))
        forward_backward(model, ids, lengths, DocumentCausalAttention([lengths], torch.device("cpu"), BACKENDS))
    assert len(model.layers) == 2
    assert counters["stats"]["unique_graphs"] == 2  # one per compiled half, traced once each


def test_selective_recompute_keeps_no_mlp_activation(tiny_model):
    """Only each block's input and attention's tensors stay alive for backward, no [T, intermediate] tensor."""
    intermediate = load_causal_lm(str(tiny_model), "cpu", "float32").args.intermediate_size

    def saved_widths(recompute: bool) -> list[int]:
        model = fp64_model(tiny_model)
        apply_training_blocks(model.layers, compile=False, recompute=recompute)
        widths = []

        def pack(t):
            widths.append(t.shape[-1] if t.dim() else 0)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, 260, (1, 12)), torch.arange(12)[None],
                  attention=DocumentCausalAttention([[12]], torch.device("cpu"), BACKENDS))
        return widths

    assert intermediate in saved_widths(recompute=False)
    assert intermediate not in saved_widths(recompute=True)
