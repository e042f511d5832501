"""The router shell (``Router``: the linear and the routing) against float64 autograd of the
naive code (``x @ W^T + b``, then the pure router) on the same route: the gradients reaching
the input, the router weight and its bias through the routing weights, the logits (an
auxiliary loss), or both; with the linear fused into the router kernel (on the GPU, else in
the Triton interpreter) and without it (``F.linear``)."""

from __future__ import annotations

import pytest
import torch

from moe_fn import kernels
from moe_fn.autograd.routing import Router
from moe_fn.pure.router import SCORE_FUNCS, router_fwd
from moe_fn.testing import assert_all_close_to_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.float16  # the kernel's dtypes are 16-bit; float16 keeps more mantissa


def _leaf(t):
    return t.detach().clone().requires_grad_()


@pytest.fixture(params=["fused", "F.linear"])
def fused(request, monkeypatch):
    """Both forms of the shell's forward on any device (the fused one in the interpreter on
    the CPU)."""
    on = request.param == "fused"
    monkeypatch.setattr(kernels, "router_linear_supported", lambda *a, **kw: on)
    return on


@pytest.mark.parametrize("norm", [True, False])  # renormalising cancels some terms
@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("uses", ["weights", "logits", "both"])
def test_router_linear_gradients(score_func, uses, fused, norm):
    t, h, e, k = 24, 40, 32, 4
    g = torch.Generator().manual_seed(len(score_func) + len(uses))
    x0 = torch.randn(t, h, generator=g).to(DT)
    w0 = (torch.randn(e, h, generator=g) / h ** 0.5).to(DT)
    b0 = (torch.randn(e, generator=g) * 0.1).to(DT)
    cw = torch.randn(t, k, generator=g, dtype=torch.float64)
    cl = torch.randn(t, e, generator=g, dtype=torch.float64)
    corr = torch.randn(e, generator=g) * 0.1

    x, w, b = (_leaf(v.to(DEV)) for v in (x0, w0, b0))
    logits, idx, wt = Router.apply(x, w, b, corr.to(DEV), k, score_func, norm, 1, 1,
                                   "top2_sum", 2.0, None)
    loss = 0
    if uses in ("weights", "both"):
        loss = loss + (wt.double() * cw.to(DEV)).sum()
    if uses in ("logits", "both"):
        loss = loss + (logits.double() * cl.to(DEV)).sum()
    loss.backward()

    def naive_grads(dtype):
        """Autograd of the naive code in ``dtype`` on the CPU: float64 is the oracle, float16
        plain PyTorch for the tolerance rule."""
        xn, wn, bn = (_leaf(v.to(dtype)) for v in (x0, w0, b0))
        logits_n = xn @ wn.t() + bn
        (_, wt_n), _ = router_fwd(logits_n, corr.to(dtype), top_k=k, score_func=score_func,
                                  norm_topk_prob=norm, routed_scaling_factor=2.0,
                                  topk_idx=idx.cpu())
        loss_n = 0
        if uses in ("weights", "both"):
            loss_n = loss_n + (wt_n.double() * cw).sum()
        if uses in ("logits", "both"):
            loss_n = loss_n + (logits_n.double() * cl).sum()
        return torch.autograd.grad(loss_n, (xn, wn, bn))

    got = [v.grad.cpu() for v in (x, w, b)]
    assert all(g.dtype == DT for g in got)
    assert_all_close_to_ref(got, naive_grads(DT), naive_grads(torch.float64),
                            ("x", "weight", "bias"))


def test_router_linear_without_linear_bias_or_input_grad(fused):
    x = torch.randn(8, 16, dtype=DT, device=DEV)  # input that needs no gradient
    w = torch.randn(16, 16, dtype=DT, device=DEV).requires_grad_()
    logits, idx, wt = Router.apply(x, w, None, None, 2, "softmax", False, 1, 1,
                                         "top2_sum", 1.0, None)
    wt.sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape and x.grad is None


def test_router_linear_double_backward_through_the_logits_only(fused):
    """An auxiliary loss on the logits alone differentiates twice through the linear (as it
    did through F.linear); a gradient through the routing weights is first order only."""
    x = torch.randn(6, 16, dtype=DT, device=DEV, requires_grad=True)
    w = torch.randn(16, 16, dtype=DT, device=DEV, requires_grad=True)
    args = (None, 2, "softmax", False, 1, 1, "top2_sum", 1.0, None)
    logits, _, _ = Router.apply(x, w, None, *args)
    (gx,) = torch.autograd.grad(logits.float().square().sum(), x, create_graph=True)
    gx.float().sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad.float()).all()
    _, _, wt = Router.apply(x, w, None, *args)
    with pytest.raises(RuntimeError, match="first-order only"):
        torch.autograd.grad(wt.sum(), x, create_graph=True)
