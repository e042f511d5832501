"""The balancing losses' gradient, injected in the layer's own backward."""

from __future__ import annotations

import torch

from ..pure.balance import ProbBalanceRes, ZLossRes, prob_balance_bwd, z_loss_bwd
from ..records import BalanceTerms
from ._common import refuse_double_backward


def terms_grad(terms: BalanceTerms, logits: torch.Tensor) -> torch.Tensor | None:
    """``d_logits (T, E)`` of ``sum coefficient * loss`` over the terms (None if none)."""
    grads = []
    for term in (terms.switch, terms.sequence):
        if term is not None:
            coef, weights = term
            res = ProbBalanceRes(logits, weights, None, terms.score_func)
            grads.append(prob_balance_bwd(res, coef))
    if terms.z:
        grads.append(z_loss_bwd(ZLossRes(logits), terms.z))
    grads.extend(g for g in (t.grad(logits) for t in terms.extra) if g is not None)
    if not grads:
        return None
    total = grads[0]
    for g in grads[1:]:
        total = total + g
    return total


class BalanceGrad(torch.autograd.Function):
    """``(w (T, k), logits (T, E), terms, scale) -> w``: the routing weights unchanged. The
    backward passes their gradient through and also returns the balancing losses' gradient
    to the logits (``terms_grad`` times ``scale.grad_scale``, read then), so that it
    arrives with the layer's own backward, in every checkpoint mode — as Megatron-Core's
    MoEAuxLossAutoScaler attaches its loss to the activations, with the gradient computed
    explicitly here."""

    @staticmethod
    def forward(ctx, w, logits, terms, scale):
        ctx.save_for_backward(logits)
        ctx.terms, ctx.scale = terms, scale
        ctx.set_materialize_grads(False)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, d_w):
        refuse_double_backward("BalanceGrad")
        d_logits = None
        if ctx.needs_input_grad[1]:
            (logits,) = ctx.saved_tensors
            d_logits = terms_grad(ctx.terms, logits)
            s = ctx.scale.grad_scale
            if d_logits is not None and not (isinstance(s, float) and s == 1.0):
                d_logits = d_logits * (s.to(d_logits.dtype).to(d_logits.device)
                                       if isinstance(s, torch.Tensor) else s)
        return d_w, d_logits, None, None
