"""Thin autograd shells over the pure pairs of the expert computation.

Each forward calls a pair (activations and row weighting through ``moe_fn.kernels``, which
sends CUDA tensors to Triton and CPU tensors to the pure code), saves only tensors, keeps
static ints on ``ctx`` and rebuilds the residual in backward. Backwards are first-order.
"""

from __future__ import annotations

import torch

from .. import kernels
from .._checks import debug_checks
from ..pure.activations import SwigluPackedRes, SwigluRes
from ..pure.experts import ExpertsRes, experts_bwd, experts_bwd_input, experts_fwd
from ..pure.experts_fp8 import (
    ExpertsFp8Res,
    experts_fp8_bwd,
    experts_fp8_bwd_input,
    experts_fp8_fwd,
)
from ..pure.fp8 import Fp8Rows
from ..pure.grouped import GroupedLinearRes, grouped_linear_bwd, grouped_linear_fwd
from ..pure.row_weight import RowWeightRes
from ._common import refuse_double_backward

# What the FP8 shells quantise with: CUDA tensors through the Triton kernels, others the
# pure twins (moe_fn.kernels dispatches by device).
FP8_IMPL = kernels


class GroupedLinear(torch.autograd.Function):
    """``y = grouped x @ weight^T``; see ``moe_fn.functional.grouped_linear``."""

    @staticmethod
    def forward(ctx, x, weight, offs):
        y, _ = grouped_linear_fwd(x, weight, offs)
        ctx.save_for_backward(x, weight, offs)
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("GroupedLinear")
        x, weight, offs = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dx, dw = grouped_linear_bwd(GroupedLinearRes(x, weight, offs), dy.contiguous(),
                                    needs=(needs[0], needs[1]))
        return dx, dw, None


class Swiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weights, act_id: int, alpha: float, limit: float):
        h, _ = kernels.swiglu_fwd(gate, up, weights, act_id=act_id, alpha=alpha, limit=limit)
        ctx.save_for_backward(gate, up, weights)
        ctx.statics = (act_id, alpha, limit)
        return h

    @staticmethod
    def backward(ctx, dh):
        refuse_double_backward("Swiglu")
        gate, up, weights = ctx.saved_tensors
        res = SwigluRes(gate, up, weights, *ctx.statics)
        n = ctx.needs_input_grad
        dg, du, dw = kernels.swiglu_bwd(res, dh.contiguous(), needs=(n[0], n[1], n[2]))
        return dg, du, dw, None, None, None


class SwigluPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, weights, act_id: int, alpha: float, limit: float, layout_id: int):
        h, _ = kernels.swiglu_packed_fwd(gate_up, weights, act_id=act_id, alpha=alpha,
                                         limit=limit, layout_id=layout_id)
        ctx.save_for_backward(gate_up, weights)
        ctx.statics = (act_id, alpha, limit, layout_id)
        return h

    @staticmethod
    def backward(ctx, dh):
        refuse_double_backward("SwigluPacked")
        gate_up, weights = ctx.saved_tensors
        res = SwigluPackedRes(gate_up, weights, *ctx.statics)
        n = ctx.needs_input_grad
        dgu, dw = kernels.swiglu_packed_bwd(res, dh.contiguous(), needs=(n[0], n[1]))
        return dgu, dw, None, None, None, None


class RowWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weights):
        out, _ = kernels.row_weight_fwd(rows, weights)
        ctx.save_for_backward(rows, weights)
        return out

    @staticmethod
    def backward(ctx, d_out):
        refuse_double_backward("RowWeight")
        rows, weights = ctx.saved_tensors
        n = ctx.needs_input_grad
        return kernels.row_weight_bwd(RowWeightRes(rows, weights), d_out.contiguous(),
                                      needs=(n[0], n[1]))


class Experts(torch.autograd.Function):
    """The expert MLP; see ``moe_fn.functional.experts``."""

    @staticmethod
    def forward(ctx, x, gate_up_proj, down_proj, offs, weights, gate_up_bias, down_bias,
                act_id: int, alpha: float, limit: float, layout_id: int, fused: bool,
                weight_grad_slot=None):
        y, res = experts_fwd(x, gate_up_proj, down_proj, offs, weights, gate_up_bias, down_bias,
                             act_id=act_id, alpha=alpha, limit=limit, layout_id=layout_id,
                             fused=fused, act_impl=kernels)
        ctx.save_for_backward(x, gate_up_proj, down_proj, offs, res.gate_up, res.gate, res.up,
                              res.h, weights)
        ctx.statics = (act_id, alpha, limit, layout_id, fused, kernels, res.has_gate_up_bias,
                       res.has_down_bias)
        ctx.slot = weight_grad_slot
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("Experts")
        res = ExpertsRes(*ctx.saved_tensors, *ctx.statics)
        n = ctx.needs_input_grad
        statics = (None,) * 6
        if ctx.slot is not None:
            # Overlap: dX now; the dW GEMMs (and bias sums) run in the dispatch backward,
            # beside the combine.
            dx, d_w, work = experts_bwd_input(res, dy.contiguous(), needs_x=n[0],
                                              needs_weights=n[4])
            ctx.slot.fill(work)
            return (dx, None, None, None, d_w, None, None) + statics
        dx, d_gup, d_down, d_w, d_gub, d_db = experts_bwd(
            res, dy.contiguous(), needs=(n[0], n[1], n[2], n[4], n[5], n[6]))
        return (dx, d_gup, d_down, None, d_w, d_gub, d_db) + statics


def check_fp8_scales(**scales) -> None:
    """Under debug checks: a NaN row scale means that row held an inf or NaN (an overflow
    upstream), which e4m3 cannot carry (a host sync)."""
    for name, s in scales.items():
        bad = ~torch.isfinite(s)
        if bool(bad.any()):
            rows = bad.nonzero().reshape(-1)[:8].tolist()
            raise FloatingPointError(
                f"FP8 experts: {name} has non-finite values in rows {rows} (their e4m3 scale "
                "is NaN): an overflow before the experts' FP8 GEMMs. Lower the learning "
                "rate or find the inf/NaN upstream; expert_precision='native' computes "
                "without quantising")


class ExpertsFp8(torch.autograd.Function):
    """The expert MLP with FP8 GEMMs (``moe_fn.pure.experts_fp8``); see
    ``moe_fn.functional.experts(precision="fp8_rowwise")``.

    ``x`` carries the rows' gradient (``(N, H)`` in the rows' dtype: the rows themselves, or
    a zero-stride stand-in when ``x_rows`` already holds them quantised, as the FP8
    dispatch delivers them); ``x_rows`` is None (quantise ``x`` here) or their
    ``Fp8Rows``. ``w`` holds the quantised weights (``Fp8WeightCache``); the parameters
    themselves are inputs for their gradients."""

    @staticmethod
    def forward(ctx, x, x_rows, gate_up_proj, down_proj, offs, weights, gate_up_bias,
                down_bias, w, act_id: int, alpha: float, limit: float, layout_id: int,
                weight_grad_slot=None):
        if x_rows is None:
            x_rows = FP8_IMPL.quantize_rows(x)
        debug = debug_checks()
        if debug:
            check_fp8_scales(**{"the experts' input rows": x_rows.scale})
        y, res = experts_fp8_fwd(x_rows, w, offs, weights, gate_up_bias, down_bias,
                                 act_id=act_id, alpha=alpha, limit=limit, layout_id=layout_id,
                                 dtype=x.dtype, impl=FP8_IMPL)
        if debug:
            check_fp8_scales(**{"the activation's output": res.h.scale})
        ctx.save_for_backward(x_rows.q, x_rows.scale, offs, res.gate_up, res.h.q, res.h.scale,
                              weights)
        ctx.statics = (act_id, alpha, limit, layout_id, x.dtype, res.has_gate_up_bias,
                       res.has_down_bias)
        ctx.w, ctx.slot = w, weight_grad_slot
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("ExpertsFp8")
        xq, xs, offs, gate_up, hq, hs, weights = ctx.saved_tensors
        act_id, alpha, limit, layout_id, dtype, has_gub, has_db = ctx.statics
        res = ExpertsFp8Res(Fp8Rows(xq, xs), ctx.w, offs, gate_up, Fp8Rows(hq, hs), weights,
                            act_id, alpha, limit, layout_id, dtype, FP8_IMPL, has_gub, has_db)
        if debug_checks():
            check_fp8_scales(**{"the experts' output gradient": FP8_IMPL.quantize_rows(
                dy.contiguous()).scale})
        n = ctx.needs_input_grad
        statics = (None,) * 6
        if ctx.slot is not None:
            dx, d_w, work = experts_fp8_bwd_input(res, dy, needs_x=n[0], needs_weights=n[5])
            ctx.slot.fill(work)
            return (dx, None, None, None, None, d_w, None, None) + statics
        dx, d_gup, d_down, d_w, d_gub, d_db = experts_fp8_bwd(
            res, dy, needs=(n[0], n[2], n[3], n[5], n[6], n[7]))
        return (dx, None, d_gup, d_down, None, d_w, d_gub, d_db) + statics
