"""Grouped expert matmuls as one Triton kernel over tokens sorted by expert (fused-MoE style).

Why a kernel of our own: the model's eager experts (`tandem.models.moe.GroupedExperts`) size
each expert's group from `num_tokens_per_expert`, read on the host on CPU, and `torch._grouped_mm`
takes offsets the host never sees, but needs the rows gathered into sorted order first. Here the
token copies stay where they are: the kernel reads each one's row through an index, so a decode
step is a fixed grid that a CUDA graph can replay, whatever the routing.

Layout (`ExpertBlocks`, built by `align_to_blocks`: three small kernels, no host sync): the N*k
token copies (copy c = token c // k, its slot c % k) sorted by expert (stable), each expert's group
padded to a multiple of `block_m` with the sentinel N*k. `sorted_copies` [max_padded] holds copy ids,
`block_experts` [max_padded / block_m] the expert of each block of rows, `num_padded` [1] how many
rows are real groups (rows from there on are never read, nor written); max_padded = N*k + E*(block_m - 1)
rounded up, the most any routing needs, so every shape is fixed by N. Program (m, n) multiplies block m's
rows by its expert's weight [n-tile, K] and writes output rows in copy order (each row once: deterministic).
The gate_up matmul (`gated`) reads the gate and the up rows of its n-tile and writes SiLU(gate) * up:
the [N*k, 2I] intermediate is never written.

Block FP8 (`Fp8Operands`): the same kernel over FP8 rows and FP8 experts, in the scheme of `tandem.kernels.fp8`
(activations scaled per row and 128-column group, weights per 128 x 128 block of each expert): each BLOCK_K
step (a divisor of 128, so it lies in one group) is one FP8 product with fp32 sums, scaled by its row scales
and its weight columns' block scales, and added in fp32.

Reference: `tandem.models.moe.MoE` (experts: `GroupedExperts`); the row layout's is the test's `align_to_blocks`.
Tests: `tests/kernels/test_moe_kernels.py` (interpreter); on CUDA `tests/inference/test_gpu_moe.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels.fp8 import GROUP

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
    """[max_padded] int64: token copy ids grouped by expert, each group padded with N*k; rows from
    `num_padded` on are left unwritten."""
    block_experts: torch.Tensor
    """[max_padded / block_m] int64: the expert of each block of `block_m` rows."""
    num_padded: torch.Tensor
    """[1] int64: rows in real (padded) groups; blocks from there on do nothing."""
    block_m: int


@dataclass
class Fp8Operands:
    """Block scales of a grouped matmul whose rows and experts are FP8 (`tandem.kernels.fp8`'s scheme)."""

    row_scales: torch.Tensor
    """fp32 [rows of `a`, ceil(K / 128)], any strides (`quantize_activations` gives them token-minor)."""
    weight_scales: torch.Tensor
    """fp32 [E, row blocks, ceil(K / 128)]; gated: each expert's gate row blocks, then as many of its up rows."""
    out_dtype: torch.dtype
    """The dtype the rows are written in (the model's)."""


ALIGN_CHUNK = 256
"""Token copies per program of the counting and scattering kernels of `align_to_blocks`."""


def align_to_blocks(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """expert_ids [N, k] -> the kernel's row layout (see the module docstring); fixed shapes, no host sync.

    Three launches, whatever N: count each chunk's copies per expert; one program turns the counts into
    each chunk's first row per expert, the padded groups and the block experts; each chunk scatters its
    copies to their rows (stable: a copy's rank within its chunk is a running count of its expert)."""
    flat = expert_ids.reshape(-1)
    num_copies, device = flat.numel(), flat.device
    max_padded = -(-(num_copies + num_experts * (block_m - 1)) // block_m) * block_m
    num_chunks = triton.cdiv(num_copies, ALIGN_CHUNK)
    experts_p2 = triton.next_power_of_2(num_experts)
    sub_chunk = min(ALIGN_CHUNK, max(16, 4096 // experts_p2))  # one-hot tiles of [sub_chunk, experts_p2]
    chunk_rows = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    sorted_copies = torch.empty(max_padded, dtype=torch.int64, device=device)
    block_experts = torch.empty(max_padded // block_m, dtype=torch.int64, device=device)
    num_padded = torch.empty(1, dtype=torch.int64, device=device)
    sizes = dict(NUM_EXPERTS=num_experts, EXPERTS_P2=experts_p2, CHUNK=ALIGN_CHUNK, SUB_CHUNK=sub_chunk)
    _count_kernel[(num_chunks,)](flat, chunk_rows, num_copies, **sizes)
    _place_groups_kernel[(1,)](chunk_rows, sorted_copies, block_experts, num_padded, num_chunks, num_copies,
                               block_experts.numel(), BLOCK_M=block_m, **sizes)
    _scatter_kernel[(num_chunks,)](flat, chunk_rows, sorted_copies, num_copies, **sizes)
    return ExpertBlocks(sorted_copies, block_experts, num_padded, block_m)


def grouped_matmul(a: torch.Tensor, weight: torch.Tensor, blocks: ExpertBlocks, rows_per_copy: int, num_copies: int,
                   config: dict, routing: torch.Tensor | None = None, gated: bool = False,
                   fp8: Fp8Operands | None = None) -> torch.Tensor:
    """out[c] = a[c // rows_per_copy] @ weight[expert(c)].T for each token copy c (times routing[c] if given);
    `gated`: weight holds gate rows then up rows [E, 2I, K], and out[c] = SiLU(gate) * up [I].

    a [N or N*k, K]; weight [E, N_out, K] (the model's own layout, read in place); routing [N*k] fp32;
    `config`: tiles (`moe_tiles`), its BLOCK_M that of `blocks`; `fp8`: `a` and `weight` are FP8, with these
    scales (BLOCK_K then divides 128)."""
    n_out, k_dim = weight.shape[1] // (2 if gated else 1), weight.shape[2]
    if config["BLOCK_M"] != blocks.block_m:
        raise ValueError(f"tiles of {config['BLOCK_M']} rows over row blocks of {blocks.block_m}")
    if fp8 is not None and GROUP % config["BLOCK_K"]:
        raise ValueError(f"FP8 experts need a BLOCK_K that divides {GROUP} (one scale group a step), got {config['BLOCK_K']}")
    out = torch.empty(num_copies, n_out, dtype=a.dtype if fp8 is None else fp8.out_dtype, device=a.device)
    row_scales = out if fp8 is None else fp8.row_scales
    weight_scales = out[None] if fp8 is None else fp8.weight_scales
    grid = (blocks.block_experts.numel() * triton.cdiv(n_out, config["BLOCK_N"]),)
    _grouped_matmul_kernel[grid](
        a, weight, out, routing if routing is not None else out, row_scales, weight_scales, blocks.sorted_copies,
        blocks.block_experts, blocks.num_padded, n_out, k_dim, num_copies, blocks.block_experts.numel(),
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0), out.stride(1),
        row_scales.stride(0), row_scales.stride(1), *weight_scales.stride(), weight_scales.shape[1] // 2,
        ROWS_PER_COPY=rows_per_copy, MUL_ROUTING=routing is not None, GATED=gated, BLOCK_FP8=fp8 is not None,
        SCALE_GROUP=GROUP, EVEN_K=k_dim % config["BLOCK_K"] == 0,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", **config)
    return out


if triton is not None:

    @triton.jit
    def _one_hot(expert_ptr, first, num_copies, NUM_EXPERTS: tl.constexpr, EXPERTS_P2: tl.constexpr,
                 SUB_CHUNK: tl.constexpr):
        """Copies first..first+SUB_CHUNK as a [SUB_CHUNK, EXPERTS_P2] int32 one-hot of their experts (rows past
        the end all zero), and their ids."""
        copies = first + tl.arange(0, SUB_CHUNK)
        experts = tl.load(expert_ptr + copies, mask=copies < num_copies, other=NUM_EXPERTS).to(tl.int32)
        return (experts[:, None] == tl.arange(0, EXPERTS_P2)[None, :]).to(tl.int32), copies

    @triton.jit(do_not_specialize=["num_copies"])
    def _count_kernel(expert_ptr, chunk_rows_ptr, num_copies, NUM_EXPERTS: tl.constexpr,
                      EXPERTS_P2: tl.constexpr, CHUNK: tl.constexpr, SUB_CHUNK: tl.constexpr):
        # chunk_rows[chunk, e] = copies of expert e in this chunk (the next kernel makes them row offsets).
        chunk = tl.program_id(0)
        counts = tl.zeros((EXPERTS_P2,), dtype=tl.int32)
        for first in range(chunk * CHUNK, chunk * CHUNK + CHUNK, SUB_CHUNK):
            one_hot, _ = _one_hot(expert_ptr, first, num_copies, NUM_EXPERTS, EXPERTS_P2, SUB_CHUNK)
            counts += tl.sum(one_hot, axis=0)
        experts = tl.arange(0, EXPERTS_P2)
        tl.store(chunk_rows_ptr + chunk * NUM_EXPERTS + experts, counts, mask=experts < NUM_EXPERTS)

    @triton.jit(do_not_specialize=["num_chunks", "num_copies", "num_blocks"])
    def _place_groups_kernel(chunk_rows_ptr, sorted_copies_ptr, block_experts_ptr, num_padded_ptr, num_chunks,
                             num_copies, num_blocks, NUM_EXPERTS: tl.constexpr, EXPERTS_P2: tl.constexpr,
                             CHUNK: tl.constexpr, SUB_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr):
        # One program. Each expert's group starts at the padded groups before it; chunk c's copies of expert e
        # follow those of chunks < c. Counts become rows in place; padding rows get the sentinel.
        experts = tl.arange(0, EXPERTS_P2)
        is_expert = experts < NUM_EXPERTS
        totals = tl.zeros((EXPERTS_P2,), dtype=tl.int32)
        for first in range(0, num_chunks, 16):
            chunks = first + tl.arange(0, 16)
            ptrs = chunk_rows_ptr + chunks[:, None] * NUM_EXPERTS + experts[None, :]
            mask = (chunks < num_chunks)[:, None] & is_expert[None, :]
            counts = tl.load(ptrs, mask=mask, other=0)
            tl.store(ptrs, tl.cumsum(counts, axis=0) - counts + totals[None, :], mask=mask)
            totals += tl.sum(counts, axis=0)
        padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        padded_end = tl.cumsum(padded, axis=0)
        group_start = padded_end - padded
        for first in range(0, num_chunks, 16):
            chunks = first + tl.arange(0, 16)
            ptrs = chunk_rows_ptr + chunks[:, None] * NUM_EXPERTS + experts[None, :]
            mask = (chunks < num_chunks)[:, None] & is_expert[None, :]
            tl.store(ptrs, tl.load(ptrs, mask=mask, other=0) + group_start[None, :], mask=mask)
        pad = tl.arange(0, BLOCK_M)
        is_pad = is_expert[:, None] & (pad[None, :] < (padded - totals)[:, None])
        tl.store(sorted_copies_ptr + (group_start + totals)[:, None] + pad[None, :], num_copies.to(tl.int64),
                 mask=is_pad)
        tl.store(num_padded_ptr, tl.sum(padded).to(tl.int64))
        for first in range(0, num_blocks, 64):
            blocks = first + tl.arange(0, 64)
            ended = (padded_end[None, :] <= (blocks * BLOCK_M)[:, None]) & is_expert[None, :]
            expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), NUM_EXPERTS - 1)
            tl.store(block_experts_ptr + blocks, expert.to(tl.int64), mask=blocks < num_blocks)

    @triton.jit(do_not_specialize=["num_copies"])
    def _scatter_kernel(expert_ptr, chunk_rows_ptr, sorted_copies_ptr, num_copies, NUM_EXPERTS: tl.constexpr,
                        EXPERTS_P2: tl.constexpr, CHUNK: tl.constexpr, SUB_CHUNK: tl.constexpr):
        # next_row[e]: where this chunk's next copy of expert e goes; a copy's rank among its expert's copies
        # of a sub-chunk is the running count of its one-hot column.
        chunk = tl.program_id(0)
        experts = tl.arange(0, EXPERTS_P2)
        next_row = tl.load(chunk_rows_ptr + chunk * NUM_EXPERTS + experts, mask=experts < NUM_EXPERTS, other=0)
        for first in range(chunk * CHUNK, chunk * CHUNK + CHUNK, SUB_CHUNK):
            one_hot, copies = _one_hot(expert_ptr, first, num_copies, NUM_EXPERTS, EXPERTS_P2, SUB_CHUNK)
            rows = tl.sum(one_hot * (tl.cumsum(one_hot, axis=0) - 1 + next_row[None, :]), axis=1)
            tl.store(sorted_copies_ptr + rows, copies.to(tl.int64), mask=copies < num_copies)
            next_row += tl.sum(one_hot, axis=0)

    # The copy count changes with every prefill; a new specialization mid-run is a compile stall.
    @triton.jit(do_not_specialize=["num_copies", "num_blocks_m"])
    def _grouped_matmul_kernel(
        a_ptr, w_ptr, out_ptr, routing_ptr, as_ptr, ws_ptr, sorted_copies_ptr, block_experts_ptr, num_padded_ptr,
        n_out, k_dim, num_copies, num_blocks_m,
        stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
        stride_asm, stride_asg, stride_wse, stride_wsr, stride_wsg, up_scale_rows,
        ROWS_PER_COPY: tl.constexpr, MUL_ROUTING: tl.constexpr, GATED: tl.constexpr, BLOCK_FP8: tl.constexpr,
        SCALE_GROUP: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
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
        n_ok = offs_n < n_out
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = tl.where(real, copies // ROWS_PER_COPY, 0)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GATED only (else unused, and dropped)
        # BLOCK_FP8: the scales of each step's group, for the rows and for the weight's row blocks (gate, then up).
        as_ptrs = as_ptr + a_rows * stride_asm
        ws_ptrs = ws_ptr + expert * stride_wse + (offs_n // SCALE_GROUP) * stride_wsr
        for k0 in range(0, k_dim, BLOCK_K):
            a_mask = real[:, None]
            w_mask = n_ok[None, :]
            if not EVEN_K:
                k_ok = offs_k < k_dim - k0
                a_mask = a_mask & k_ok[None, :]
                w_mask = w_mask & k_ok[:, None]
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            if BLOCK_FP8:
                group = k0 // SCALE_GROUP
                a_scale = tl.load(as_ptrs + group * stride_asg, mask=real, other=0.0)
                w_scale = tl.load(ws_ptrs + group * stride_wsg, mask=n_ok, other=0.0)
                acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
            else:
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GATED:  # the up rows: n_out rows below the gate rows
                w_up = tl.load(w_ptrs + n_out * stride_wn, mask=w_mask, other=0.0)
                if BLOCK_FP8:
                    up_scale = tl.load(ws_ptrs + up_scale_rows * stride_wsr + group * stride_wsg, mask=n_ok, other=0.0)
                    acc_up += tl.dot(a, w_up) * a_scale[:, None] * up_scale[None, :]
                else:
                    acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up
        if MUL_ROUTING:
            acc = acc * tl.load(routing_ptr + copies, mask=real, other=0.0)[:, None]
        out_ptrs = out_ptr + copies[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=real[:, None] & n_ok[None, :])
