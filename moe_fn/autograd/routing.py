"""Router and exchange shells: route, dispatch rows to experts, combine them back."""

from __future__ import annotations

import torch

from .. import kernels
from ..comm.base import sm_carveout
from ..pure.experts import experts_bwd_weight
from ..pure.router import RouterRes, router_bwd
from ._common import contiguous_grad, refuse_double_backward


def _save_route(ctx, res: RouterRes, *tensors) -> None:
    """Save ``tensors`` and what the routing's backward needs of ``res`` (the scores only
    for softmax); ``_saved_route`` gives them back."""
    ctx.has_scores = res.scores is not None
    route = (res.scores, res.topk_idx, res.topk_raw) if ctx.has_scores else res[1:3]
    ctx.save_for_backward(*tensors, *route)
    ctx.n_other = len(tensors)
    ctx.static = res[3:]


def _saved_route(ctx) -> tuple[list, RouterRes]:
    saved = list(ctx.saved_tensors)
    other, route = saved[:ctx.n_other], saved[ctx.n_other:]
    scores = route.pop(0) if ctx.has_scores else None
    return other, RouterRes(scores, route[0], route[1], *ctx.static)


class Router(torch.autograd.Function):
    """``logits (T, E) -> (topk_idx (T, k), topk_weight (T, k))``; gradients via the weights.
    (MoELayer uses ``RouterLinear`` instead where its kernel runs.)"""

    @staticmethod
    def forward(ctx, logits, bias, top_k, score_func, norm_topk_prob, n_group, topk_group,
                group_score, routed_scaling_factor, replay_idx):
        # One fused Triton launch on CUDA in eager mode (see kernels.router_fwd for when
        # it falls back, a replayed route among them); the pure pair otherwise.
        (idx, w), res = kernels.router_fwd(
            logits, bias, top_k=top_k, score_func=score_func, norm_topk_prob=norm_topk_prob,
            n_group=n_group, topk_group=topk_group, group_score=group_score,
            routed_scaling_factor=routed_scaling_factor, topk_idx=replay_idx)
        _save_route(ctx, res)
        ctx.mark_non_differentiable(idx)
        return idx, w

    @staticmethod
    def backward(ctx, d_idx, d_w):
        refuse_double_backward("Router")
        _, res = _saved_route(ctx)
        d_logits = router_bwd(res, contiguous_grad(d_w)) if d_w is not None else None
        return (d_logits,) + (None,) * 9


class RouterLinear(torch.autograd.Function):
    """``(x (T, H), weight (E, H), lin_bias) -> (logits (T, E), topk_idx, topk_weight)``: the
    router's linear and its routing in one launch (``kernels.router_linear_fwd``). Backward
    is the routing's (the weights' gradient to the logits), plus any gradient the logits
    get themselves (an auxiliary loss), then the linear's."""

    @staticmethod
    def forward(ctx, x, weight, lin_bias, bias, top_k, score_func, norm_topk_prob, n_group,
                topk_group, group_score, routed_scaling_factor, replay_idx):
        logits, (idx, w), res = kernels.router_linear_fwd(
            x, weight, lin_bias, bias, top_k=top_k, score_func=score_func,
            norm_topk_prob=norm_topk_prob, n_group=n_group, topk_group=topk_group,
            group_score=group_score, routed_scaling_factor=routed_scaling_factor,
            topk_idx=replay_idx)
        _save_route(ctx, res, x, weight)
        ctx.has_lin_bias = lin_bias is not None
        ctx.mark_non_differentiable(idx)
        # Logits nobody differentiates get None, not a (T, E) tensor of zeros to add.
        ctx.set_materialize_grads(False)
        return logits, idx, w

    @staticmethod
    def backward(ctx, d_logits, _d_idx, d_w):
        (x, weight), res = _saved_route(ctx)
        g = d_logits
        if d_w is not None:
            # The routing's backward is first order; a gradient reaching only the logits
            # goes through the linear's torch ops below, which create_graph can differentiate.
            refuse_double_backward("RouterLinear")
            g_w = router_bwd(res, contiguous_grad(d_w))
            g = g_w if g is None else g_w + g
        if g is None:
            return (None,) * 12
        n = ctx.needs_input_grad
        dx = g.mm(weight) if n[0] else None
        d_weight = g.t().mm(x) if n[1] else None
        d_lin_bias = g.sum(0) if ctx.has_lin_bias and n[2] else None
        return (dx, d_weight, d_lin_bias) + (None,) * 9


class Dispatch(torch.autograd.Function):
    """Token rows and routing weights to expert rows on the ranks that own the experts.

    Returns ``(rows, row_weights, handle)``; the handle (not a tensor) is what the combine
    and a replayed dispatch reuse. Backward sends the row gradients (and routing-weight
    gradients) back to the tokens' home ranks and sums each token's k rows.

    With ``weight_grad_slot`` (overlap_weight_grad) the expert weights are inputs too: the
    backward starts the combine of dX asynchronously, runs the experts' deferred dW GEMMs
    from the slot with ``carveout`` SMs withheld (CUDA), waits for the combine, and returns
    dW as the weights' gradients (and, when the experts have biases, passed as
    ``gate_up_bias`` / ``down_bias``, their gradients too).
    """

    @staticmethod
    def forward(ctx, x, weights, exchange, layout, cached, gate_up_proj=None, down_proj=None,
                weight_grad_slot=None, carveout=None, gate_up_bias=None, down_bias=None):
        rows, row_w, handle = exchange.dispatch_fwd(x, weights, layout, cached=cached)
        ctx.slot, ctx.carveout = weight_grad_slot, carveout
        ctx.exchange, ctx.handle = exchange, handle
        ctx.has_weights = weights is not None
        ctx.row_meta = (rows.shape, rows.dtype, rows.device)
        return rows, (row_w if row_w is not None else rows.new_empty(0)), handle

    @staticmethod
    def backward(ctx, d_rows, d_row_w, _d_handle):
        refuse_double_backward("Dispatch")
        d_rows = contiguous_grad(d_rows)
        if d_rows is None:
            shape, dtype, device = ctx.row_meta
            d_rows = torch.zeros(shape, dtype=dtype, device=device)
        d_row_w = contiguous_grad(d_row_w) if ctx.has_weights else None
        if ctx.slot is None:
            dx, d_w = ctx.exchange.dispatch_bwd(ctx.handle, d_rows, d_row_w)
            return (dx, d_w) + (None,) * 9
        work = ctx.slot.drain()
        pending = ctx.exchange.start_dispatch_bwd(ctx.handle, d_rows, d_row_w)
        n = ctx.needs_input_grad
        try:
            with sm_carveout(ctx.carveout):
                d_gup, d_down, d_gub, d_db = experts_bwd_weight(work,
                                                                needs=(n[5], n[6], n[9], n[10]))
        finally:
            dx, d_w = pending.wait()
        return dx, d_w, None, None, None, d_gup, d_down, None, None, d_gub, d_db


class Combine(torch.autograd.Function):
    """Expert rows back to their tokens, summed over k; backward is a cached dispatch.

    With ``weights (T, k)`` (exchanges with ``home_weighting``) the sum is weighted at
    home; with ``row_weights (N,)`` (exchanges that ``fold_row_weights``) each row is
    weighted inside the expert side's per-token sum. Either way the backward also returns
    the weights' gradient."""

    @staticmethod
    def forward(ctx, rows, exchange, handle, weights=None, row_weights=None):
        ctx.exchange, ctx.handle = exchange, handle
        ctx.mode = "home" if weights is not None else "rows" if row_weights is not None else ""
        if ctx.mode == "home":
            out, src = exchange.combine_weighted_fwd(rows, weights, handle)
            ctx.save_for_backward(src, weights)
            return out
        if ctx.mode == "rows":
            ctx.save_for_backward(rows, row_weights)
            return exchange.combine_row_weighted_fwd(rows, row_weights, handle)
        return exchange.combine_fwd(rows, handle)[0]

    @staticmethod
    def backward(ctx, d_out):
        refuse_double_backward("Combine")
        d_out = contiguous_grad(d_out)
        if ctx.mode == "home":
            src, weights = ctx.saved_tensors
            d_rows, d_w = ctx.exchange.combine_weighted_bwd(ctx.handle, d_out, weights, src)
            return d_rows, None, None, d_w, None
        if ctx.mode == "rows":
            rows, row_weights = ctx.saved_tensors
            d_rows, d_rw = ctx.exchange.combine_bwd_weighted_rows(ctx.handle, d_out, rows,
                                                                  row_weights, fused=True)
            return d_rows, None, None, None, d_rw
        return ctx.exchange.combine_bwd(ctx.handle, d_out), None, None, None, None


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
        t = handle.plan.num_tokens
        # One NaN row broadcast to (T, H): nothing the size of the output is written, and
        # an in-place write into it fails loudly.
        return torch.full((1, rows.shape[-1]), float("nan"), dtype=rows.dtype,
                          device=rows.device).expand(t, -1)

    @staticmethod
    def backward(ctx, d_out):
        refuse_double_backward("SkippedCombine")
        d_out = contiguous_grad(d_out)
        if not ctx.weighted:
            return ctx.exchange.combine_bwd(ctx.handle, d_out), None, None, None, None
        rows, row_w = ctx.saved_tensors
        d_rows, d_w = ctx.exchange.combine_bwd_weighted_rows(ctx.handle, d_out, rows, row_w,
                                                             fused=ctx.fused)
        return d_rows, d_w, None, None, None
