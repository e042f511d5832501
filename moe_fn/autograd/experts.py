"""Thin autograd shells over the pure pairs of the expert computation.

Each forward calls a pair (activations and row weighting through ``moe_fn.kernels``, which
sends CUDA tensors to Triton and CPU tensors to the pure code), saves only tensors, keeps
static ints on ``ctx`` and rebuilds the residual in backward. Backwards are first-order.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..pure.activations import SwigluPackedRes, SwigluRes
from ..pure.experts import ExpertsRes, experts_bwd, experts_bwd_input, experts_fwd
from ..pure.grouped import GroupedLinearRes, grouped_linear_bwd, grouped_linear_fwd
from ..pure.row_weight import RowWeightRes
from ._common import refuse_double_backward


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
