"""A plain FP8 linear layer for the FP8 experts' tolerance rule, written from the recipe alone.

Rows (and each weight's output channels) are quantised to float8 e4m3 with a power-of-two
scale ``2**ceil(log2(amax / 448))``; the GEMM multiplies the dequantised operands in float32
and rounds once to the input's dtype. Backward quantises the incoming gradient by rows and
the weight by its other dimension for ``dx``, and takes ``dw`` from the forward's
dequantised input. Nothing here calls moe_fn's implementation: run in float32 or bfloat16
it is "plain same-precision PyTorch" for an FP8 result, whose float64 oracle is the
unquantised computation.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def fake_quantize_rows(t: torch.Tensor) -> torch.Tensor:
    """``t (..., D)`` rounded per row to e4m3 times the row's power-of-two scale, float32."""
    t = t.float()
    amax = t.abs().amax(dim=-1, keepdim=True).double()
    exp = torch.ceil(torch.log2(torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))))
    scale = torch.exp2(exp).float()
    return (t / scale).to(torch.float8_e4m3fn).float() * scale


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        xq = fake_quantize_rows(x)
        ctx.save_for_backward(xq, w)
        ctx.dtype = x.dtype
        return (xq @ fake_quantize_rows(w).t()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xq, w = ctx.saved_tensors
        dx = fake_quantize_rows(dy) @ fake_quantize_rows(w.t()).t()
        dw = dy.float().t() @ xq
        return dx.to(ctx.dtype), dw.to(w.dtype)


def fp8_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x (n, K) @ w (N, K)^T`` with both operands quantised per row (the recipe above);
    differentiable, with the backward's GEMMs quantised too."""
    return _Fp8Linear.apply(x, w)
