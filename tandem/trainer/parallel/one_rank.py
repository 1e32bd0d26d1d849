"""One rank without FSDP: FSDP2's mixed-precision numerics on plain tensors, without its per-step host work.

At world size 1 FSDP2 shards nothing, yet every step pays for it on the host: a copy-in and copy-out
per block for each forward and each recompute, a reduce per block, and DTensor dispatch in the
optimizer and the gradient clipping (issue 23: at 4,096 tokens the H200 was busy 29% of the step).
`OneRank` computes the same numbers with plain tensors:

- the module's parameters stay the fp32 master weights, plain tensors: the optimizer (fused AdamW),
  the clipping, checkpoints (DCP) and publishing see them as they see FSDP's shards;
- when the model computes in another dtype (`param_dtype`, bf16 on CUDA), each forward swaps a
  `param_dtype` copy of every parameter into the modules, rounded from the masters in one foreach
  copy (the rounding FSDP's all-gather copy-in does); the block inputs are cast to `param_dtype` as FSDP's `cast_forward_inputs` does;
- each copy's gradient is added into its master's fp32 `.grad` as soon as autograd has finished it,
  and the copy is then freed, as FSDP's reduce (at one rank a cast to `reduce_dtype` and a copy) and
  its `+=` into the sharded gradient do; the masters come back into the modules at the end of backward
  (or after a forward without gradients).

Both paths round identically, so a one-rank run gives FSDP's losses, gradient norms and weights bit for
bit (`tests/trainer/test_one_rank.py`), and checkpoints move between them (DCP saves plain tensors and
DTensors under the same global names and shapes). The cost: the compute copies of every block live
from the start of forward until their gradients are done, where FSDP (`reshard_after_forward`) frees
each block's copy after its forward and makes it again for backward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_map


class OneRank:
    """Mixed precision over a plain one-rank model; built by `apply_one_rank`."""

    def __init__(self, root: nn.Module, param_dtype: torch.dtype):
        self.param_dtype = param_dtype
        found: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
        for module in root.modules():
            for name, param in module._parameters.items():
                if param is not None:  # a tied parameter has a slot in each module that holds it
                    found.setdefault(id(param), (param, []))[1].append((module, name))
        self.masters = [param for param, _ in found.values()]
        self.slots = [slots for _, slots in found.values()]
        self.compute: list[nn.Parameter] = []
        self.installed = False
        self.backward_pending = False

    def _cast(self, master: nn.Parameter) -> bool:
        return master.is_floating_point() and master.dtype != self.param_dtype

    def _make_copies(self) -> None:
        """The compute copies, once the masters live on their device (after `to_empty` and loading)."""
        for master in self.masters:
            if not self._cast(master):
                self.compute.append(master)
                continue
            copy = nn.Parameter(torch.empty_like(master, dtype=self.param_dtype), requires_grad=master.requires_grad)
            if master.requires_grad:
                copy.register_post_accumulate_grad_hook(self._fold_gradient(master))
            self.compute.append(copy)

    def _refresh(self) -> None:
        """Round the masters into the compute copies, every time: backward freed most copies, and the masters'
        version counters cannot tell whether they changed (fused AdamW does not bump them)."""
        if not self.compute:
            self._make_copies()
        pairs = [(copy, master) for copy, master in zip(self.compute, self.masters) if copy is not master]
        with torch.no_grad():
            for copy, master in pairs:
                storage = copy.untyped_storage()
                if storage.size() == 0:
                    storage.resize_(copy.numel() * copy.element_size())
            torch._foreach_copy_([copy for copy, _ in pairs], [master for _, master in pairs])

    def _swap_in(self, params: list[nn.Parameter]) -> None:
        for param, slots in zip(params, self.slots):
            for module, name in slots:
                module._parameters[name] = param

    def install(self) -> None:
        """Put the (refreshed) compute copies into the modules."""
        if not self.installed:
            self._refresh()
            self._swap_in(self.compute)
            self.installed = True

    def uninstall(self) -> None:
        """Put the masters back into the modules."""
        if self.installed:
            self._swap_in(self.masters)
            self.installed = False

    def _fold_gradient(self, master: nn.Parameter):
        def fold(copy: nn.Parameter) -> None:
            if not self.backward_pending:  # once per backward: put the masters back when it ends
                self.backward_pending = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            with torch.no_grad():
                if master.grad is None:
                    master.grad = copy.grad.to(master.dtype)
                else:
                    master.grad += copy.grad
            copy.grad = None
            copy.untyped_storage().resize_(0)  # as FSDP frees a block's gathered weights after its backward
        return fold

    def _end_backward(self) -> None:
        self.backward_pending = False
        self.uninstall()

    def pre_forward(self, module: nn.Module, args: tuple) -> None:
        self.install()

    def post_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if not torch.is_grad_enabled():  # no backward follows: the masters go back now
            self.uninstall()


def cast_block_inputs(dtype: torch.dtype):
    """A forward pre-hook casting a block's floating tensor inputs to `dtype`, as FSDP's `cast_forward_inputs`."""
    def cast(x: object) -> object:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tree_map(cast, args), tree_map(cast, kwargs)
    return hook


def apply_one_rank(root: nn.Module, blocks: nn.ModuleList, param_dtype: torch.dtype) -> OneRank | None:
    """Compute `root` in `param_dtype` over its fp32 masters as FSDP2 at one rank would; None when there is
    nothing to cast (every parameter is already `param_dtype`: the plain module is FSDP's numerics already)."""
    one_rank = OneRank(root, param_dtype)
    if not any(one_rank._cast(master) for master in one_rank.masters):
        return None
    for block in blocks:
        block.register_forward_pre_hook(cast_block_inputs(param_dtype), with_kwargs=True)
    root.register_forward_pre_hook(one_rank.pre_forward)
    root.register_forward_hook(one_rank.post_forward)
    return one_rank
