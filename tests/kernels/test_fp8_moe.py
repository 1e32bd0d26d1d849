"""FP8 experts: the grouped MoE kernel in block FP8 (`tandem.kernels.moe` with `Fp8Operands`, driven by
`tandem.inference.engine.fused_moe`) against the experts' reference (`tandem.models.fp8.Fp8Experts`: expert by expert,
`fp8_linear`'s torch scheme), and the reference against the unquantized experts within e4m3's bound.

Each grouped matmul is held to the reference on the same quantized rows: each product of FP8 values is exact in
fp32, so the two differ by the order of fp32 sums (under Triton's interpreter) or by the tensor cores' sums of each
group (`TENSOR_CORE_SUM`, on CUDA), then by the rounding of the result. The whole MoE is held to the reference MoE
within one e4m3 step: the two round the hidden rows (SiLU(gate) * up) to the model's dtype at different points
(and Triton's interpreter truncates its casts to FP8), so a few of those rows' FP8 values differ by one step."""

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_fp8 import TENSOR_CORE_SUM, UNIT

from tandem.kernels.fp8 import FP8, BlockFp8Weight, kernel_serves, reference_matmul, reference_quantize_activations
from tandem.models.fp8 import Fp8Experts, quantize_weight
from tandem.models.moe import MoE, MoEArgs
from triton_interpreter import needs_triton_interpreter, run_interpreted

SUMS = 2.0 ** -18
"""fp32 sums of a few hundred terms in another order, and the result's fp32 rounding, relative to sum |a| |w|."""
ARGS = MoEArgs(num_experts=8, top_k=2, hidden_size=200, intermediate_size=96, norm_topk_prob=True)
"""Widths off the 128 grid (masked K steps; gate and up of 96 rows, each in a block of its own)."""


def fp8_moe(device: str, dtype: torch.dtype, seed: int = 0) -> tuple[MoE, MoE]:
    """(the MoE with random experts in `dtype`, the same MoE with those experts quantized into `Fp8Experts`)."""
    gen = torch.Generator().manual_seed(seed)
    moe = MoE(ARGS)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    # Experts of very different sizes, so that each expert's scales matter.
    moe.experts.gate_up_proj.data *= torch.logspace(-2, 1, ARGS.num_experts)[:, None, None]
    moe = moe.to(device, dtype)
    experts = Fp8Experts(ARGS.num_experts, ARGS.hidden_size, ARGS.intermediate_size, dtype).to(device)
    for attr, parts in (("gate_up_proj", 2), ("down_proj", 1)):
        weight, scale_inv = quantize_weight(getattr(moe.experts, attr).detach(), parts)
        getattr(experts, attr).copy_(weight)
        getattr(experts, attr + "_scale_inv").copy_(scale_inv)
    quantized = copy.deepcopy(moe)
    quantized.experts = experts
    return moe, quantized


def magnitudes(weight: BlockFp8Weight) -> BlockFp8Weight:
    """|weight|, in the same blocks (the sign bit of each FP8 value cleared)."""
    return BlockFp8Weight((weight.weight.view(torch.uint8) & 0x7F).view(FP8), weight.scale_inv, weight.scale_rows)


def reference_copy_rows(a_fp8, a_scale, experts: Fp8Experts, expert_ids, rows_per_copy, gated):
    """Each token copy's row of one grouped matmul by the reference (fp64), and the sum of |a| |w| its error scales
    with (gated: carried through SiLU(gate) * up as |gate| |up| bounds it)."""
    values, scales = [], []
    for c, expert in enumerate(expert_ids.reshape(-1).tolist()):
        row = slice(c // rows_per_copy, c // rows_per_copy + 1)
        weight = experts.expert_weights(expert)[0 if gated else 1]
        y = reference_matmul(a_fp8[row], a_scale[row], weight, None, torch.float64)[0]
        m = reference_matmul(magnitudes(BlockFp8Weight(a_fp8[row], a_scale[row], None)).weight, a_scale[row],
                             magnitudes(weight), None, torch.float64)[0]
        if gated:
            (gate, up), (gate_m, up_m) = y.chunk(2), m.chunk(2)
            y, m = F.silu(gate) * up, gate_m * up.abs() + gate.abs() * up_m + gate_m * up_m
        values.append(y)
        scales.append(m)
    return torch.stack(values), torch.stack(scales)


def check_fp8_experts(device: str) -> None:
    """The kernel against the reference, for decode-sized and prefill-sized token counts, with the rule's tiles and
    with tiles of a BLOCK_K of 64 (two steps a scale group)."""
    from tandem.inference.engine.fused_moe import expert_scales, fused_experts
    from tandem.kernels import moe as moe_kernel
    from tandem.kernels.moe_tiles import rule_tiles

    group_sum = TENSOR_CORE_SUM if device == "cuda" else 0.0
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    moe, quantized = fp8_moe(device, dtype)
    experts = quantized.experts
    gen = torch.Generator().manual_seed(1)
    half_k = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=2)
    for num_tokens, tiles in ((1, None), (40, None), (150, None), (40, half_k)):
        rule = rule_tiles(num_tokens, ARGS.top_k, ARGS.num_experts, fp8=True)
        tiles = tiles or rule
        x = torch.randn(num_tokens, ARGS.hidden_size, generator=gen).to(device, dtype)
        with torch.no_grad():
            weights, expert_ids = quantized.gate(x)
        blocks = moe_kernel.align_to_blocks(expert_ids, ARGS.num_experts, tiles["BLOCK_M"])
        num_copies = expert_ids.numel()
        # gate_up, gated, on the reference's quantized rows.
        x_fp8, x_scale = reference_quantize_activations(x)
        fp8 = moe_kernel.Fp8Operands(x_scale, experts.gate_up_proj_scale_inv, torch.float32)
        hidden = moe_kernel.grouped_matmul(x_fp8, experts.gate_up_proj, blocks, ARGS.top_k, num_copies, tiles,
                                           gated=True, fp8=fp8)
        expected, scale = reference_copy_rows(x_fp8, x_scale, experts, expert_ids, ARGS.top_k, gated=True)
        assert ((hidden.double() - expected).abs() <= (group_sum + SUMS) * scale + 1e-30).all(), (num_tokens, tiles)
        # down, times the routing weights, on the reference's quantized hidden rows.
        h_fp8, h_scale = reference_quantize_activations(hidden)
        fp8 = moe_kernel.Fp8Operands(h_scale, experts.down_proj_scale_inv, torch.float32)
        routing = weights.reshape(-1)
        down = moe_kernel.grouped_matmul(h_fp8, experts.down_proj, blocks, 1, num_copies, tiles, routing, fp8=fp8)
        expected, scale = reference_copy_rows(h_fp8, h_scale, experts, expert_ids, 1, gated=False)
        routing_64 = routing[:, None].double()
        error = (down.double() - expected * routing_64).abs()
        assert (error <= (group_sum + SUMS) * scale * routing_64 + 1e-30).all(), (num_tokens, tiles)
        # The whole MoE, as the engine runs it (the kernels quantize rows themselves), against the reference MoE.
        with torch.no_grad():
            got = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, expert_ids, (tiles, tiles),
                                expert_scales(experts))
            want = quantized(x[None])[0]
            unquantized = moe(x[None])[0]
        assert got.dtype == dtype
        difference = (got.float() - want.float()).norm() / want.float().norm()
        assert difference <= UNIT, (num_tokens, float(difference))  # one e4m3 step on a few rows' values at most
        # And FP8 stays within e4m3's reach of the unquantized experts: four FP8 factors.
        assert 0 < (want.float() - unquantized.float()).norm() / unquantized.float().norm() <= 4 * UNIT


INTERPRETED = """
import sys
sys.path.insert(0, {tests!r})
from test_fp8_moe import check_fp8_experts

check_fp8_experts("cpu")
print("ok")
"""


@needs_triton_interpreter
def test_fp8_experts_under_tritons_interpreter_match_the_reference():
    run_interpreted(INTERPRETED.format(tests=str(Path(__file__).parent)), timeout=900)


@pytest.mark.skipif(not torch.cuda.is_available() or not kernel_serves(torch.device("cuda")),
                    reason="needs a CUDA GPU of compute capability 8.9 or newer, and Triton")
def test_fp8_experts_on_cuda_match_the_reference():
    check_fp8_experts("cuda")


def test_the_reference_experts_stay_within_e4m3_of_the_unquantized_ones():
    """On any device: the reference MoE (`Fp8Experts`' forward) against the MoE of the same unquantized experts."""
    moe, quantized = fp8_moe("cpu", torch.float32)
    x = torch.randn(1, 30, ARGS.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = moe(x), quantized(x)
    relative = ((got - want).norm() / want.norm()).item()
    assert 0 < relative <= 4 * UNIT, relative
