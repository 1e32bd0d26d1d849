"""Grouped expert matmuls as one Triton kernel over tokens sorted by expert (fused-MoE style).

Why a kernel of our own: the model's eager experts (`tandem.models.moe.GroupedExperts`) size
each expert's group from `num_tokens_per_expert`, read on the host on CPU, and `torch._grouped_mm`
takes offsets the host never sees, but needs the rows gathered into sorted order first. Here the
token copies stay where they are: the kernel reads each one's row through an index, so a decode
step is a fixed grid that a CUDA graph can replay, whatever the routing.

Layout (`ExpertBlocks`, built by `align_to_blocks` with torch ops, no host sync): the N*k token
copies (copy c = token c // k, its slot c % k) sorted by expert, each expert's group padded to a
multiple of `block_m` with the sentinel N*k. `sorted_copies` [max_padded] holds copy ids,
`block_experts` [max_padded / block_m] the expert of each block of rows, `num_padded` [1] how many
rows are real groups; max_padded = N*k + E*(block_m - 1) rounded up, the most any routing needs,
so every shape is fixed by N. Program (m, n) multiplies block m's rows by its expert's weight
[n-tile, K] and writes output rows in copy order (each row once: deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.models.moe import permute

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine keeps the model's eager experts
    triton = None


def is_available(x: torch.Tensor) -> bool:
    """Whether the kernel can serve these activations (CUDA, Triton installed)."""
    return triton is not None and x.is_cuda


@dataclass
class ExpertBlocks:
    sorted_copies: torch.Tensor
    """[max_padded] int64: token copy ids grouped by expert, each group padded with N*k."""
    block_experts: torch.Tensor
    """[max_padded / block_m] int64: the expert of each block of `block_m` rows."""
    num_padded: torch.Tensor
    """[1] int64: rows in real (padded) groups; blocks from there on do nothing."""
    block_m: int


def align_to_blocks(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """expert_ids [N, k] -> the kernel's row layout (see the module docstring); fixed shapes, no host sync."""
    num_copies = expert_ids.numel()
    order, counts = permute(expert_ids, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # where each expert's copies start in `order`
    experts_sorted = expert_ids.reshape(-1)[order]
    rank = torch.arange(num_copies, device=order.device) - first[experts_sorted]
    max_padded = -(-(num_copies + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_copies = torch.full((max_padded,), num_copies, dtype=torch.int64, device=order.device)
    sorted_copies[padded_end[experts_sorted] - padded[experts_sorted] + rank] = order
    block_starts = torch.arange(0, max_padded, block_m, device=order.device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertBlocks(sorted_copies, block_experts, padded_end[-1:], block_m)


def block_config(num_tokens: int, top_k: int, num_experts: int) -> dict:
    """Tile sizes from the mean rows per expert: each expert's group is padded to a row block, so
    small blocks when few tokens reach each expert (decode), larger ones for prefill."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3)
    if rows_per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def grouped_matmul(a: torch.Tensor, weight: torch.Tensor, blocks: ExpertBlocks, rows_per_copy: int, num_copies: int,
                   config: dict, routing: torch.Tensor | None = None) -> torch.Tensor:
    """out[c] = a[c // rows_per_copy] @ weight[expert(c)].T for each token copy c (times routing[c] if given).

    a [N or N*k, K]; weight [E, N_out, K] (the model's own layout, read in place); routing [N*k] fp32."""
    n_out, k_dim = weight.shape[1], weight.shape[2]
    out = torch.empty(num_copies, n_out, dtype=a.dtype, device=a.device)
    grid = (blocks.block_experts.numel() * triton.cdiv(n_out, config["BLOCK_N"]),)
    _grouped_matmul_kernel[grid](
        a, weight, out, routing if routing is not None else out, blocks.sorted_copies, blocks.block_experts,
        blocks.num_padded, n_out, k_dim, num_copies, blocks.block_experts.numel(),
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0), out.stride(1),
        ROWS_PER_COPY=rows_per_copy, MUL_ROUTING=routing is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", **config)
    return out


if triton is not None:

    # The copy count changes with every prefill; a new specialization mid-run is a compile stall.
    @triton.jit(do_not_specialize=["num_copies", "num_blocks_m"])
    def _grouped_matmul_kernel(
        a_ptr, w_ptr, out_ptr, routing_ptr, sorted_copies_ptr, block_experts_ptr, num_padded_ptr,
        n_out, k_dim, num_copies, num_blocks_m,
        stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
        ROWS_PER_COPY: tl.constexpr, MUL_ROUTING: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # Programs walk GROUP_M row blocks down one column of tiles before the next: weights stay in L2.
        pid = tl.program_id(0)
        num_blocks_n = tl.cdiv(n_out, BLOCK_N)
        per_group = GROUP_M * num_blocks_n
        first_m = (pid // per_group) * GROUP_M
        group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_size
        pid_n = (pid % per_group) // group_size
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        copies = tl.load(sorted_copies_ptr + offs_m)
        real = copies < num_copies
        expert = tl.load(block_experts_ptr + pid_m)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = tl.where(real, copies // ROWS_PER_COPY, 0)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):
            k_ok = offs_k < k_dim - k0
            a = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < n_out), other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        if MUL_ROUTING:
            acc = acc * tl.load(routing_ptr + copies, mask=real, other=0.0)[:, None]
        out_ptrs = out_ptr + copies[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=real[:, None] & (offs_n[None, :] < n_out))
