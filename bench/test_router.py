"""Router: top-k routing of the logits (moe_fn's router op: one Triton kernel on a GPU)
against plain PyTorch as the HF blocks route (softmax + ``torch.topk`` for Qwen3 and
Mixtral; DeepSeek-V3's sigmoid, choice bias and expert groups), and the router's linear
fused into it (``router_linear_fwd``) against ``F.linear`` + the plain routing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_fn.kernels as ops
from bench import harness, plain, shapes
from bench.checks import check, f64, stable_tokens
from bench.harness import CLOCK
from bench.shapes import KERNEL_MODELS, names

ARMS = ("moe_fn", "torch")
_inputs = harness.Latest()


def _make(model):
    t, e, h = model.tokens, model.experts, model.hidden
    x = harness.randn(t, h, seed=1)
    weight = harness.randn(e, h, scale=0.02, seed=2)
    bias = (0.01 * torch.randn(e, device=harness.device(), generator=harness.generator(3))
            if model.routing.get("score_correction_bias") else None)
    return x, weight, F.linear(x, weight), bias


def _route_kwargs(model):
    return {k: v for k, v in model.routing.items() if k != "score_correction_bias"}


def _check(model, arm, got, logits_fn, x, bias, abs_logits_fn=None):
    """The arm's routes on the tokens no rounding can reroute: the experts as plain
    PyTorch's, the weights by the tolerance rule against plain and float64."""
    if got[0].is_floating_point():
        w, idx = got
    else:
        idx, w = got
    logits64 = logits_fn(f64(x))
    s = stable_tokens(logits64, model, x.dtype, bias,
                      None if abs_logits_fn is None else abs_logits_fn(f64(x).abs()))
    assert s.float().mean() > 0.25, "too few well-routed tokens to check the router"
    # A route is a set of experts: order each token's choices by expert, since equal
    # logits (common in bf16) among the chosen may come in either order.
    (w, idx), (pw, pidx), (rw, ridx) = (_by_expert(*r) for r in (
        (w, idx), plain.route(logits_fn(x), model, bias), plain.route(logits64, model, bias)))
    assert torch.equal(idx[s], ridx[s]) and torch.equal(pidx[s], ridx[s]), arm
    check(w[s], pw[s], rw[s], arm)


def _by_expert(w, idx):
    order = idx.long().argsort(-1)
    return w.gather(-1, order), idx.long().gather(-1, order)


def _out_bytes(model):
    return model.tokens * model.top_k * (8 + 4)  # int64 indices, float32 weights


@pytest.mark.benchmark(group="router", timer=CLOCK)
@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("model", names(KERNEL_MODELS))
def test_router(measure, model, arm):
    model = shapes.get(model)
    _, _, logits, bias = _inputs.get(model.name, lambda: _make(model))
    kw = _route_kwargs(model)
    if arm == "moe_fn":
        def fn():
            return ops.router_fwd(logits, bias, top_k=model.top_k, **kw)[0]
    else:
        def fn():
            return plain.route(logits, model, bias)
    _check(model, arm, fn(), lambda t: t, logits, bias)
    measure(fn, shape=model.name, nbytes=logits.numel() * logits.element_size()
            + _out_bytes(model), flush_l2=True)


@pytest.mark.benchmark(group="router linear", timer=CLOCK)
@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("model", names(KERNEL_MODELS))
def test_router_linear(measure, model, arm):
    model = shapes.get(model)
    x, weight, _, bias = _inputs.get(model.name, lambda: _make(model))
    kw = _route_kwargs(model)
    if arm == "moe_fn":
        def fn():
            return ops.router_linear_fwd(x, weight, None, bias, top_k=model.top_k, **kw)[1]
    else:
        def fn():
            return plain.route(F.linear(x, weight), model, bias)
    _check(model, arm, fn(), lambda t: F.linear(t, f64(weight) if t.dtype == torch.float64
                                                else weight), x, bias,
           lambda t: F.linear(t, f64(weight).abs()))  # the arm computes the logits
    measure(fn, shape=model.name, flops=2 * model.tokens * model.hidden * model.experts,
            flush_l2=True,
            info={"fused_linear": ops.router_linear_supported(x, weight, None,
                                                              model.routing.get("n_group", 1))})
