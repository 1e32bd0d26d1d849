"""The engine's compiled RMS norms replace every norm of the model and compute what it computed."""

import functools

import torch

from tandem.inference.engine import fused_norms
from tandem.models.layers import RMSNorm


def test_every_norm_is_routed_and_keeps_its_parameter(tiny_model, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # the routing, without code generation
    model = type(tiny_model)(tiny_model.args)
    model.load_state_dict(tiny_model.state_dict())
    ids = torch.randint(0, 256, (1, 9))
    before = model(ids, torch.arange(9)[None])
    names = [n for n, _ in model.named_parameters()]
    fused_norms.apply_compiled_norms(model)
    assert all(not isinstance(m, RMSNorm) or isinstance(m.forward, functools.partial) for m in model.modules())
    assert [n for n, _ in model.named_parameters()] == names
    assert torch.equal(model(ids, torch.arange(9)[None]), before)
