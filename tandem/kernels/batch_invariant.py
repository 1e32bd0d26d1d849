"""Batch-invariant Triton kernels: a row's result is bitwise the same whatever rows stand beside it.

Exact mode's fast path (`tandem.models.exact`) computes every linear, RMS norm and the sampled
distribution's log_softmax with these, in the engine and in the trainer alike. Why they are invariant:
their launch configuration is a constant (never chosen from the number of rows), a row's reduction
runs over fixed chunks in a fixed order inside one program, and nothing is split across programs:

- `linear`: y = x @ W.T (+ bias), fixed BLOCK_M x BLOCK_N tiles, the K loop over BLOCK_K chunks
  accumulating in fp32 through `tl.dot` (no split-K); a tile's rows do not mix in a matrix product, so a
  row gets the same sums at any row of any tile, whatever M (not specialised: one compiled kernel);
- `rms_norm`: one program per row, the whole row in one block;
- `log_softmax`: one program per row of logits, log_softmax(logits / T) over fixed vocabulary chunks.

Backward passes (the trainer's) are plain torch: only forward values must match the engine's.
On the CPU they run under Triton's interpreter (`TRITON_INTERPRET=1`), which is how the tests check
them; without it the CPU keeps exact mode's token-by-token torch path.

Reference: torch's `F.linear`, `tandem.models.layers.rms_norm` and `log_softmax(logits / T)`, each row alone.
Tests: `tests/kernels/test_batch_invariant.py` (also exact mode's attention and pointwise kernels).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: exact mode runs token by token (`tandem.models.exact`)
    triton = None


def is_available(device: torch.device) -> bool:
    """Whether these kernels can run on `device`: Triton on CUDA, or Triton's interpreter on the CPU."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


LINEAR_LAUNCH = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
"""The one tile configuration of every linear, whatever its shapes (batch invariance forbids choosing
it from M; one configuration for all also keeps one instruction mix for all)."""

LOG_SOFTMAX_BLOCK = 4096
"""Vocabulary entries per chunk of `log_softmax` (a constant: the reduction order depends on it)."""


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            x = tl.load(x_rows + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
            w = tl.load(w_rows + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K), other=0.0)
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, eps, stride_x, stride_y, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK)
        ok = d < D
        x = tl.load(x_ptr + row * stride_x + d, mask=ok, other=0.0)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
        normed = (xf * rstd).to(x.dtype)  # cast back before the weight, as `layers.rms_norm` does
        w = tl.load(w_ptr + d, mask=ok, other=0.0)
        y = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(y_ptr + row * stride_y + d, y.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _log_softmax_kernel(x_ptr, t_ptr, y_ptr, V, stride_x, stride_y, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        inv_t = 1.0 / tl.load(t_ptr + row)
        v = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: running max and sum, reduced at the end
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            ok = start + v < V
            x = tl.load(x_ptr + row * stride_x + start + v, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
            m = m_new
        row_max = tl.max(m, 0)
        lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), 0))
        for start in range(0, V, BLOCK):
            ok = start + v < V
            x = tl.load(x_ptr + row * stride_x + start + v, mask=ok, other=0.0).to(tl.float32) * inv_t
            tl.store(y_ptr + row * stride_y + start + v, x - lse, mask=ok)


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd must record this call: the wrappers below skip their `autograd.Function` otherwise (its
    Python cost per call would make the exact engine's uncaptured prefill steps host-bound)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    launch: dict = LINEAR_LAUNCH) -> torch.Tensor:
    """`launch`: the engine's constant; the sweep of `benchmarks/exact_kernels.py` tries others."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    weight = weight.contiguous()
    M, K = x2.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    grid = (triton.cdiv(M, launch["BLOCK_M"]), triton.cdiv(N, launch["BLOCK_N"]))
    if M:
        _linear_kernel[grid](x2, weight, bias if bias is not None else weight, y, M, N, K, x2.stride(0), weight.stride(0),
                             y.stride(0), HAS_BIAS=bias is not None, IEEE=y.dtype == torch.float32, **launch)
    return y.view(*shape[:-1], N)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight
        grad_w = grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, each row of x computed alike whatever the others (x [..., K], weight [N, K])."""
    return _Linear.apply(x, weight, bias) if needs_grad(x, weight, bias) else _linear_forward(x, weight, bias)


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, x2.shape[1], eps, x2.stride(0), y.stride(0),
                                         BLOCK=triton.next_power_of_2(x2.shape[1]))
    return y.view(shape)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _rms_norm_forward(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        from tandem.models.layers import rms_norm as reference  # the model's formula, differentiated by torch

        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
            grad_x, grad_w = torch.autograd.grad(reference(x, weight, ctx.eps), (x, weight), grad)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`tandem.models.layers.rms_norm` (fp32 statistics, cast back, then the weight), one program per row."""
    return _RMSNorm.apply(x, weight, eps) if needs_grad(x, weight) else _rms_norm_forward(x, weight, eps)


def _log_softmax_forward(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    logits = logits.contiguous()
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if logits.shape[0]:
        _log_softmax_kernel[(logits.shape[0],)](logits, temperatures.float().contiguous(), out, logits.shape[1],
                                                logits.stride(0), out.stride(0), BLOCK=LOG_SOFTMAX_BLOCK)
    return out


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, temperatures):
        out = _log_softmax_forward(logits, temperatures)
        ctx.save_for_backward(out, temperatures)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, temperatures = ctx.saved_tensors
        grad_logits = (grad - out.exp() * grad.sum(-1, keepdim=True)) / temperatures.float()[:, None]
        return grad_logits, None


def log_softmax(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) [N, V] fp32 of logits [N, V], each row at its temperature (`temperatures` [N])."""
    return _LogSoftmax.apply(logits, temperatures) if needs_grad(logits) else _log_softmax_forward(logits, temperatures)
