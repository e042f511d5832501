"""Triton kernels for row weighting (``moe_fn.pure.row_weight`` is the contract).

Forward ``out = rows * w[:, None]``; backward ``d_rows = d_out * w`` and
``d_w = sum_j d_out * rows`` in one pass. A program owns ``BLOCK_R`` rows and walks the
columns in ``BLOCK_C`` chunks (the ``d_w`` reduction stays in float32 registers). Inputs
may have any strides (``d_out`` may be an expanded, zero-stride view); outputs are
contiguous. Launch configuration and autotuning are shared with the activation kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import int32_columns
from .activation import _CONFIGS, _check_kernel_dtype, _launch, _prune


@triton.jit
def _row_weight_fwd_kernel(x_ptr, w_ptr, out_ptr, N, H, s_xr, s_xc, s_w, s_or,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < N
    w = tl.load(w_ptr + rows * s_w, mask=rmask, other=0.0).to(tl.float32)
    for c0 in range(0, H, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + rows[:, None] * s_xr + cols[None, :] * s_xc, mask=m, other=0.0)
        y = x.to(tl.float32) * w[:, None]
        tl.store(out_ptr + rows[:, None] * s_or + cols[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _row_weight_bwd_kernel(x_ptr, w_ptr, d_ptr, dx_ptr, dw_ptr, N, H,
                           s_xr, s_xc, s_w, s_dr, s_dc, s_dxr,
                           NEED_DX: tl.constexpr, NEED_DW: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < N
    if NEED_DX:
        w = tl.load(w_ptr + rows * s_w, mask=rmask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, H, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols < H)[None, :]
        d = tl.load(d_ptr + rows[:, None] * s_dr + cols[None, :] * s_dc, mask=m, other=0.0)
        d = d.to(tl.float32)
        if NEED_DX:
            tl.store(dx_ptr + rows[:, None] * s_dxr + cols[None, :],
                     (d * w[:, None]).to(dx_ptr.dtype.element_ty), mask=m)
        if NEED_DW:
            x = tl.load(x_ptr + rows[:, None] * s_xr + cols[None, :] * s_xc, mask=m, other=0.0)
            acc += tl.sum(d * x.to(tl.float32), axis=1)
    if NEED_DW:
        tl.store(dw_ptr + rows, acc.to(dw_ptr.dtype.element_ty), mask=rmask)


_fwd_tuned = triton.autotune(_CONFIGS, key=["H"],
                             prune_configs_by={"early_config_prune": _prune})(
    _row_weight_fwd_kernel)
_bwd_tuned = triton.autotune(_CONFIGS, key=["H", "NEED_DX", "NEED_DW"],
                             prune_configs_by={"early_config_prune": _prune})(
    _row_weight_bwd_kernel)


def launch_row_weight_fwd(rows, weights):
    """Triton ``rows * weights[:, None]`` on any device (CPU needs TRITON_INTERPRET=1)."""
    _check_kernel_dtype(rows, "rows")
    rows = int32_columns(rows)
    n, h = rows.shape
    out = torch.empty((n, h), dtype=rows.dtype, device=rows.device)
    if n == 0 or h == 0:
        return out
    _launch(_row_weight_fwd_kernel, _fwd_tuned, n, h,
            rows, weights, out, n, h, rows.stride(0), rows.stride(1), weights.stride(0),
            out.stride(0))
    return out


def launch_row_weight_bwd(rows, weights, d_out, needs=(True, True)):
    """Returns ``(d_rows | None, d_weights | None)``."""
    _check_kernel_dtype(rows, "rows")
    rows, d_out = int32_columns(rows), int32_columns(d_out)
    n, h = rows.shape
    dx = torch.empty((n, h), dtype=rows.dtype, device=rows.device) if needs[0] else None
    dw = torch.empty((n,), dtype=weights.dtype, device=rows.device) if needs[1] else None
    if n == 0 or not (needs[0] or needs[1]):
        return dx, dw
    if h == 0:
        return dx, (dw.zero_() if dw is not None else None)
    _launch(_row_weight_bwd_kernel, _bwd_tuned, n, h,
            rows, weights, d_out, dx if dx is not None else rows,
            dw if dw is not None else weights, n, h,
            rows.stride(0), rows.stride(1), weights.stride(0), d_out.stride(0), d_out.stride(1),
            dx.stride(0) if dx is not None else 0,
            NEED_DX=dx is not None, NEED_DW=dw is not None)
    return dx, dw
