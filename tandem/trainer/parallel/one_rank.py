"""One rank without FSDP: FSDP2's mixed-precision numerics on plain tensors, without its per-step host work.

At world size 1 FSDP2 shards nothing, yet every step pays for it on the host: a copy-in and copy-out
per block for each forward and each recompute, a reduce per block, and DTensor dispatch in the
optimizer and the gradient clipping, enough on a small model's short steps to leave the GPU idle most of
the step (`benchmarks/results/trainer-profile-h200-2026-12-03-4096.json`; both paths timed in
`benchmarks/results/trainer-h200-2026-12-04-one-rank.json` and
`benchmarks/results/trainer-h200-2026-12-04-fsdp-at-one-rank.json`).
`OneRank` computes the same numbers with plain tensors:

- the module's parameters stay the fp32 master weights, plain tensors: the optimizer (fused AdamW),
  the clipping, checkpoints (DCP) and publishing see them as they see FSDP's shards;
- when the model computes in another dtype (`param_dtype`, bf16 on CUDA), each forward swaps a
  `param_dtype` copy of every parameter into the modules; a block's copies are rounded from the
  masters in one foreach copy at the block's forward (the cast FSDP's all-gather copy-in does), the
  others (embeddings, final norm, LM head) at the root's; the block inputs are cast to `param_dtype`
  (FSDP's `cast_forward_inputs`);
- with `reshard_after_forward`, a block's copies are freed after its forward and rounded again when
  backward reaches the block (a hook on its output's gradient), as FSDP frees and re-gathers them;
- each copy's gradient is added into its master's fp32 `.grad` as soon as autograd has finished it,
  and the copy is then freed, as FSDP's reduce (at one rank a cast to `reduce_dtype` and a copy) and
  its `+=` into the sharded gradient do; the masters come back into the modules at the end of backward
  (or after a forward without gradients).

Both paths round identically, so a one-rank run gives FSDP's losses, gradient norms and weights bit for
bit (`tests/trainer/test_one_rank.py`), and checkpoints move between them (DCP saves plain tensors and
DTensors under the same global names and shapes). The host work left per block and pass: one foreach
copy, a storage resize per parameter and, in backward, one hook per parameter.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from tandem.models.moe import fp32_router_parameters


class OneRank:
    """Mixed precision over a plain one-rank model; built by `apply_one_rank`."""

    def __init__(self, root: nn.Module, blocks: nn.ModuleList, param_dtype: torch.dtype, reshard_after_forward: bool,
                 per_block: bool = True):
        self.param_dtype = param_dtype
        self.reshard_after_forward = reshard_after_forward
        self.per_block = per_block
        found: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
        for module in root.modules():
            for name, param in module._parameters.items():
                if param is not None:  # a tied parameter has a slot in each module that holds it
                    found.setdefault(id(param), (param, []))[1].append((module, name))
        self.masters = [param for param, _ in found.values()]
        self.kept_fp32 = fp32_router_parameters(root)
        """The routers that compute in fp32 (`moe.fp32_routers`): their masters are their compute copies."""
        self.slots = [slots for _, slots in found.values()]
        index = {id(param): i for i, param in enumerate(self.masters)}
        self.block_params = {id(block): [index[id(p)] for p in block.parameters()] for block in blocks}
        """Indices (into `masters`) of each block's parameters: rounded at its forward, freed after it."""
        in_blocks = {i for indices in self.block_params.values() for i in indices}
        self.root_params = [i for i in range(len(self.masters)) if i not in in_blocks] if per_block else list(range(len(self.masters)))
        """Those rounded at the root's forward: outside every block (embeddings, final norm, LM head), or all of them
        without `per_block`."""
        self.compute: list[nn.Parameter] = []
        self.installed = False
        self.backward_pending = False

    def casts(self) -> bool:
        """Whether any parameter computes in another dtype than its master's (else the plain module is FSDP's numerics)."""
        return any(self._cast(master) for master in self.masters)

    def _cast(self, master: nn.Parameter) -> bool:
        return master.is_floating_point() and master.dtype != self.param_dtype and id(master) not in self.kept_fp32

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

    def _round(self, indices: list[int]) -> None:
        """Round these masters into their compute copies, every time: backward freed the copies, and the masters'
        version counters cannot tell whether they changed (fused AdamW does not bump them)."""
        pairs = [(self.compute[i], self.masters[i]) for i in indices if self.compute[i] is not self.masters[i]]
        if not pairs:  # all already in the compute dtype (a LoRA model's frozen base)
            return
        with torch.no_grad(), contextlib.ExitStack() as versions:
            for copy, _ in pairs:
                storage = copy.untyped_storage()
                if storage.size() == 0:
                    storage.resize_(copy.numel() * copy.element_size())
                # Before a block's backward the copy gets back the values autograd saved: not a change to them.
                versions.enter_context(torch.autograd._unsafe_preserve_version_counter(copy))
            torch._foreach_copy_([copy for copy, _ in pairs], [master for _, master in pairs])

    def _free(self, indices: list[int]) -> None:
        for i in indices:
            if self.compute[i] is not self.masters[i]:
                self.compute[i].untyped_storage().resize_(0)

    def _swap_in(self, params: list[nn.Parameter]) -> None:
        for param, slots in zip(params, self.slots):
            for module, name in slots:
                module._parameters[name] = param

    def install(self) -> None:
        """Put the compute copies into the modules (the blocks' are rounded at each block's forward)."""
        if not self.installed:
            if not self.compute:
                self._make_copies()
            self._round(self.root_params)
            self._swap_in(self.compute)
            self.installed = True

    def uninstall(self) -> None:
        """Put the masters back into the modules; without `per_block`, free the compute copies (after a backward
        their gradients freed them already; after a forward without gradients nothing else would)."""
        if self.installed:
            self._swap_in(self.masters)
            self.installed = False
            if not self.per_block:
                self._free(self.root_params)

    def _fold_gradient(self, master: nn.Parameter):
        # A weak reference: the hook lives in the copy's C++ autograd metadata, where the garbage collector
        # does not look, so a strong one would make copy -> hook -> self -> copy a cycle it cannot free (every
        # model built in a process, e.g. one per benchmark shape, would keep its fp32 masters).
        owner = weakref.ref(self)

        def fold(copy: nn.Parameter) -> None:
            self = owner()
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

    def block_pre_forward(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Round the block's weights; cast its floating inputs to `param_dtype` (FSDP's `cast_forward_inputs`)."""
        self._round(self.block_params[id(block)])

        def cast(x: object) -> object:
            return x.to(self.param_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        return tree_map(cast, args), tree_map(cast, kwargs)

    def block_post_forward(self, block: nn.Module, args: tuple, output: object) -> None:
        """`reshard_after_forward`: free the block's copies, and round them again when backward reaches the block
        (its output's gradient is complete before any of the block's backward, recompute included, runs)."""
        if not self.reshard_after_forward:
            return
        indices = self.block_params[id(block)]
        self._free(indices)
        if torch.is_grad_enabled():
            outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            hooked = []

            def round_once(grad: torch.Tensor) -> None:
                if not hooked:  # several outputs: the first gradient ready
                    hooked.append(True)
                    self._round(indices)
            for t in outputs:
                t.register_hook(round_once)


def apply_one_rank(root: nn.Module, blocks: nn.ModuleList, param_dtype: torch.dtype,
                   reshard_after_forward: bool, per_block: bool = True) -> OneRank | None:
    """Compute `root` in `param_dtype` over its fp32 masters as FSDP2 at one rank would; None when there is
    nothing to cast (every parameter is already `param_dtype`: the plain module is FSDP's numerics already).
    `per_block`: round each block's copies at its own forward (and with `reshard_after_forward` free them after
    it); without, every copy is rounded at the root's forward and kept until backward has used it (the compiled
    stack, `tandem.trainer.stack`, calls no block module: the same numbers, the blocks' copies held for the pass).
    The blocks' inputs are cast to `param_dtype` by the block hooks only: without them the caller's embeddings
    already compute in it."""
    one_rank = OneRank(root, blocks, param_dtype, reshard_after_forward, per_block)
    if not one_rank.casts():
        return None
    for block in blocks if per_block else ():
        block.register_forward_pre_hook(one_rank.block_pre_forward, with_kwargs=True)
        block.register_forward_hook(one_rank.block_post_forward)
    root.register_forward_pre_hook(one_rank.pre_forward)
    root.register_forward_hook(one_rank.post_forward)
    return one_rank
