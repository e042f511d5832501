"""Router and exchange shells: route, dispatch rows to experts, combine them back."""

from __future__ import annotations

import torch

from .. import kernels
from ..comm.base import Gathered, Summation
from ..comm.carveout import sm_carveout
from ..pure.experts import experts_bwd_weight
from ..pure.experts_fp8 import ExpertsFp8WgradWork, experts_fp8_bwd_weight
from ..pure.fp8 import unpack_rows_fp8
from ..pure.router import RouterLinearRes, RouterRes, router_linear_bwd
from ..pure.row_weight import RowWeightRes
from ._common import contiguous_grad, refuse_double_backward
from .experts import FP8_IMPL


class Router(torch.autograd.Function):
    """``(x (T, H), weight (E, H), lin_bias) -> (logits (T, E), topk_idx (T, k), topk_weight
    (T, k))``: the router's linear and its routing (``kernels.router_linear_fwd``: one Triton
    launch on CUDA where it runs). Backward: the routing's (the weights' gradient to the
    logits), plus any gradient the logits get themselves (an auxiliary loss), then the
    linear's."""

    @staticmethod
    def forward(ctx, x, weight, lin_bias, bias, top_k, score_func, norm_topk_prob, n_group,
                topk_group, group_score, routed_scaling_factor, replay_idx):
        logits, (idx, w), res = kernels.router_linear_fwd(
            x, weight, lin_bias, bias, top_k=top_k, score_func=score_func,
            norm_topk_prob=norm_topk_prob, n_group=n_group, topk_group=topk_group,
            group_score=group_score, routed_scaling_factor=routed_scaling_factor,
            topk_idx=replay_idx)
        route = res.route
        # The scores only for softmax, whose backward couples every expert.
        ctx.has_scores = route.scores is not None
        kept = (route.scores, route.topk_idx, route.topk_raw) if ctx.has_scores else route[1:3]
        ctx.save_for_backward(x, weight, *kept)
        ctx.static = route[3:]
        ctx.has_lin_bias = res.has_lin_bias
        ctx.mark_non_differentiable(idx)
        # Logits nobody differentiates get None, not a (T, E) tensor of zeros to add.
        ctx.set_materialize_grads(False)
        return logits, idx, w

    @staticmethod
    def backward(ctx, d_logits, _d_idx, d_w):
        x, weight, *kept = ctx.saved_tensors
        scores = kept.pop(0) if ctx.has_scores else None
        res = RouterLinearRes(x, weight, ctx.has_lin_bias,
                              RouterRes(scores, kept[0], kept[1], *ctx.static))
        if d_w is not None:
            # The routing's backward is first order; a gradient reaching only the logits
            # goes through the linear's torch ops, which create_graph can differentiate.
            refuse_double_backward("Router")
            d_w = contiguous_grad(d_w)
        grads = router_linear_bwd(res, d_logits, d_w, needs=ctx.needs_input_grad[:3])
        return grads + (None,) * 9


class Dispatch(torch.autograd.Function):
    """Token rows and routing weights to expert rows on the ranks that own the experts.

    Returns ``(rows, row_weights, handle, x_rows)``; the handle (not a tensor) is what the
    combine and a replayed dispatch reuse. With ``fp8`` over an exchange that
    ``encodes_rows``, the rows travel quantised (``moe_fn.pure.fp8``'s packed rows, written
    by the exchange's gather: half the bytes of bf16): ``x_rows`` holds them as ``Fp8Rows``
    and ``rows`` is a zero-stride ``(N, H)`` stand-in through which their gradient comes
    back; otherwise ``x_rows`` is None and ``rows`` the rows. Backward sends the row
    gradients (and routing-weight gradients) back to the tokens' home ranks and sums each
    token's k rows.

    With ``weight_grad_slot`` (overlap_weight_grad) the expert weights are inputs too: the
    backward starts the combine of dX asynchronously, runs the experts' deferred dW GEMMs
    from the slot with ``carveout`` SMs withheld (CUDA), waits for the combine, and returns
    dW as the weights' gradients (and, when the experts have biases, passed as
    ``gate_up_bias`` / ``down_bias``, their gradients too).
    """

    @staticmethod
    def forward(ctx, x, weights, exchange, layout, cached, fp8=False, gate_up_proj=None,
                down_proj=None, weight_grad_slot=None, carveout=None, gate_up_bias=None,
                down_bias=None):
        x_rows = None
        if fp8 and exchange.encodes_rows:
            packed, row_w, handle = exchange.dispatch(x, weights, layout, cached=cached,
                                                      encode=FP8_IMPL.quantize_rows_packed)
            x_rows = unpack_rows_fp8(packed, x.shape[1])
            rows = x.new_zeros(()).expand(packed.shape[0], x.shape[1])
        else:
            rows, row_w, handle = exchange.dispatch(x, weights, layout, cached=cached)
        ctx.slot, ctx.carveout = weight_grad_slot, carveout
        ctx.exchange, ctx.handle = exchange, handle
        ctx.has_weights = weights is not None
        ctx.row_meta = (rows.shape, rows.dtype, rows.device)
        return rows, (row_w if row_w is not None else rows.new_empty(0)), handle, x_rows

    @staticmethod
    def backward(ctx, d_rows, d_row_w, _d_handle, _d_x_rows):
        refuse_double_backward("Dispatch")
        d_rows = contiguous_grad(d_rows)
        if d_rows is None:
            shape, dtype, device = ctx.row_meta
            d_rows = torch.zeros(shape, dtype=dtype, device=device)
        d_row_w = contiguous_grad(d_row_w) if ctx.has_weights else None
        if ctx.slot is None:
            dx, d_w = ctx.exchange.dispatch_backward(ctx.handle, d_rows, d_row_w).wait()
            return (dx, d_w) + (None,) * 10
        work = ctx.slot.drain()
        pending = ctx.exchange.dispatch_backward(ctx.handle, d_rows, d_row_w, async_op=True)
        n = ctx.needs_input_grad
        try:
            with sm_carveout(ctx.carveout):
                d_gup, d_down, d_gub, d_db = weight_grads(work, needs=(n[6], n[7], n[10], n[11]))
        finally:
            dx, d_w = pending.wait()
        return dx, d_w, None, None, None, None, d_gup, d_down, None, None, d_gub, d_db


def weight_grads(work, *, needs):
    """The deferred weight gradients of either expert path's ``work``."""
    if isinstance(work, ExpertsFp8WgradWork):
        return experts_fp8_bwd_weight(work, needs=needs)
    return experts_bwd_weight(work, needs=needs)


class Combine(torch.autograd.Function):
    """Expert rows back to their tokens, summed over k; backward is a cached dispatch.

    With ``weights`` the sum is weighted inside the exchange's own sum, where its
    ``summation`` says: ``(T, k)`` routing weights at home (``Summation.HOME``), or ``(N,)``
    row weights as the dispatch delivered them on the expert side (``Summation.EXPERTS``;
    the backward is then the unweighted combine's followed by that weighting's, fused).
    Either way the backward also returns the weights' gradient. ``needs_grad`` False (the
    caller knows no backward will run: no grad mode, as in a reentrant checkpoint's first
    forward) lets the home-weighted sum keep nothing for it."""

    @staticmethod
    def forward(ctx, rows, exchange, handle, weights=None, needs_grad=True):
        ctx.exchange, ctx.handle = exchange, handle
        ctx.mode = ("" if weights is None else
                    "home" if exchange.summation is Summation.HOME else "rows")
        out, saved = exchange.combine(rows, handle, weights=weights, keep=needs_grad)
        if ctx.mode == "home" and needs_grad:
            ctx.save_for_backward(saved, weights)
        elif ctx.mode == "rows":
            ctx.save_for_backward(rows, weights)
        return out

    @staticmethod
    def backward(ctx, d_out):
        refuse_double_backward("Combine")
        d_out = contiguous_grad(d_out)
        if ctx.mode == "home":
            saved = ctx.saved_tensors  # once: a checkpoint's hooks unpack each tensor once
            if not saved:
                raise RuntimeError("Combine was told no backward would run (needs_grad=False) "
                                   "and kept nothing for one: pass needs_grad=True whenever "
                                   "its rows or weights require grad under grad mode")
            src, weights = saved
            d_rows, d_w = ctx.exchange.combine_backward(ctx.handle, d_out, weights=weights,
                                                        saved=src)
            return d_rows, None, None, d_w, None
        if ctx.mode == "rows":
            rows, row_weights = ctx.saved_tensors
            d_rows, d_rw = row_weighting_backward(
                ctx.exchange.combine_backward_gathered(ctx.handle, d_out), rows, row_weights)
            return d_rows, None, None, d_rw, None
        return ctx.exchange.combine_backward(ctx.handle, d_out)[0], None, None, None, None


def row_weighting_backward(d: Gathered, rows, row_weights, *, fused: bool = True):
    """The backward of ``rows * row_weights[:, None]`` for the gradient ``d`` of the
    weighted rows, given as a gather not yet run: ``(d_rows, d_row_weights)``. ``fused``:
    the gather and the weighting's backward in one Triton pass (float32 math); else what
    autograd computes for the eager weighting ``rows * w.to(rows.dtype)[:, None]``
    (``MoELayer._weight_rows``), in the rows' dtype."""
    if not fused:
        d = d.materialize()
        w = row_weights.to(rows.dtype)[:, None]
        return d * w, (d * rows).sum(-1).to(row_weights.dtype)
    if d.index is None and d.own is None:
        return kernels.row_weight_bwd(RowWeightRes(rows, row_weights), d.src)
    return kernels.gather_row_weight_bwd(d.src, d.index, rows, row_weights, own=d.own,
                                         own_tokens=d.own_index)


class SkippedCombine(torch.autograd.Function):
    """A combine (and post-expert row weighting) recorded, not executed.

    Used only in a supported reentrant recompute, whose output feeds nothing but the
    residual add the checkpoint discards: the forward returns a NaN sentinel of the
    output's shape without communicating; the backward is the real one — a cached dispatch
    of the output gradient, then the row weighting's backward when ``row_weights`` is given
    (``rows`` are then the unweighted expert outputs).
    """

    @staticmethod
    def forward(ctx, rows, row_weights, exchange, handle, fused_weighting):
        ctx.exchange, ctx.handle, ctx.fused = exchange, handle, fused_weighting
        ctx.weighted = row_weights is not None
        if ctx.weighted:
            ctx.save_for_backward(rows, row_weights)
        exchange.counters["combine_skipped"] += 1
        return exchange.resources_on(rows.device).nan_sentinel(
            handle.plan.num_tokens, rows.shape[-1], rows.dtype)

    @staticmethod
    def backward(ctx, d_out):
        refuse_double_backward("SkippedCombine")
        d_out = contiguous_grad(d_out)
        if not ctx.weighted:
            return ctx.exchange.combine_backward(ctx.handle, d_out)[0], None, None, None, None
        rows, row_w = ctx.saved_tensors
        if ctx.fused:
            d = ctx.exchange.combine_backward_gathered(ctx.handle, d_out)
        else:
            d = Gathered(ctx.exchange.combine_backward(ctx.handle, d_out)[0])
        d_rows, d_w = row_weighting_backward(d, rows, row_w, fused=ctx.fused)
        return d_rows, d_w, None, None, None
