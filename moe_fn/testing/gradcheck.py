"""Check a MoELayer's forward and gradients in float64 against the dense reference."""

from __future__ import annotations

import copy

import torch

from .. import MoEConfig, MoELayer
from .. import checkpoint as moe_checkpoint
from .reference import MoEParams, layer_params, load_params, random_params, reference_moe

# The smallest route margin a random draw must have, so that float64 rounding (or a
# finite-difference step) cannot flip a choice between the layer and the reference.
MIN_MARGIN = 1e-6
FD_MIN_MARGIN = 1e-4


def _as_float64_layer(layer_or_config, generator):
    if isinstance(layer_or_config, MoEConfig):
        layer = MoELayer(layer_or_config, dtype=torch.float64)
        load_params(layer, random_params(layer_or_config, generator=generator))
        return layer
    if not isinstance(layer_or_config, MoELayer):
        raise TypeError(f"expected a MoEConfig or MoELayer, got {type(layer_or_config).__name__}")
    if layer_or_config.config.ep_size != 1:
        raise ValueError(
            "gradcheck_layer runs one process: for expert parallelism, compare each rank's "
            "outputs and gradients with reference_moe over all experts (load_params slices "
            "them per rank)")
    return copy.deepcopy(layer_or_config).to(torch.float64)


def _leaf_copies(params: MoEParams) -> MoEParams:
    return MoEParams(*(None if t is None else t.detach().clone().requires_grad_(
        t.is_floating_point() and name != "score_correction_bias")
        for name, t in zip(MoEParams._fields, params)))


def gradcheck_layer(layer_or_config, x=None, *, d_out=None, tokens: int = 7, seed: int = 0,
                    checkpoint: bool = False, finite_differences: bool = False,
                    rtol: float | None = None, atol: float | None = None) -> dict:
    """Run a MoELayer in float64 and compare its output, router logits and the gradients of
    x and of every parameter with autograd of :func:`reference_moe` on the same tensors.

    ``layer_or_config``: a ``MoEConfig`` (a float64 layer is built with
    :func:`random_params`) or a single-rank ``MoELayer`` (a float64 copy is checked; the
    original is untouched). ``x``: ``(..., H)`` input (default ``tokens`` random rows);
    ``d_out``: the output's cotangent (default random; the logits' is always random).
    ``checkpoint``: run ``x + layer(x)`` inside
    ``moe_fn.checkpoint`` (routing replay, and the combine skip where the config asks for
    it) against ``x + reference``. ``finite_differences``: also
    ``torch.autograd.gradcheck`` the layer (outside any checkpoint: gradcheck's
    ``autograd.grad`` cannot pass a reentrant one) in x and its parameters (slow: two
    forwards per element). Tolerances: ``torch.testing.assert_close``'s float64 defaults
    unless given.

    Raises ``AssertionError`` naming the first tensor that differs; returns the largest
    absolute difference per compared tensor.
    """
    gen = torch.Generator().manual_seed(seed)
    layer = _as_float64_layer(layer_or_config, gen)
    cfg = layer.config
    need = FD_MIN_MARGIN if finite_differences else MIN_MARGIN
    if x is None:
        for _ in range(20):  # redraw inputs whose route is nearly tied
            x = torch.randn(tokens, cfg.hidden_size, generator=gen, dtype=torch.float64)
            with torch.no_grad():
                margin = reference_moe(x, layer_params(layer), cfg).route.margin
            if margin.numel() == 0 or margin.min() > need:
                break
    x = x.detach().to(torch.float64)
    if d_out is None:
        d_out = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    d_out = d_out.to(torch.float64)
    t = x.reshape(-1, cfg.hidden_size).shape[0]
    d_logits = torch.randn(t, cfg.num_experts, generator=gen, dtype=torch.float64)

    names = ["x", *MoEParams._fields]
    xl = x.clone().requires_grad_()
    mods = layer_params(layer)
    if checkpoint:
        out = moe_checkpoint(lambda h: h + layer(h), xl)
        loss, logits = (out * d_out).sum(), None
    else:
        out, logits = layer(xl, return_router_logits=True)
        loss = (out * d_out).sum() + (logits * d_logits).sum()
    got_leaves = [xl, *mods]
    wanted = [i for i, p in enumerate(got_leaves) if p is not None and p.requires_grad]
    # .backward(), not autograd.grad: a reentrant checkpoint supports only the former.
    loss.backward()
    got = [got_leaves[i].grad for i in wanted]

    xr = x.clone().requires_grad_()
    params = _leaf_copies(mods)
    ref = reference_moe(xr, params, cfg)
    if checkpoint:
        ref_out = xr + ref.out
        ref_loss = (ref_out * d_out).sum()
    else:
        ref_out = ref.out
        ref_loss = (ref.out * d_out).sum() + (ref.logits * d_logits).sum()
    ref_leaves = [xr, *params]
    want = torch.autograd.grad(ref_loss, [ref_leaves[i] for i in wanted], allow_unused=True)

    tol = {} if rtol is None and atol is None else dict(rtol=rtol or 0.0, atol=atol or 0.0)
    errors = {}

    def compare(name, a, b):
        a = torch.zeros_like(b) if a is None and b is not None else a
        b = torch.zeros_like(a) if b is None and a is not None else b
        if a is None:
            return
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")
        errors[name] = (a - b).abs().max().item() if a.numel() else 0.0

    compare("out", out.detach(), ref_out.detach())
    if logits is not None:
        compare("logits", logits.detach(), ref.logits.detach())
    for i, a, b in zip(wanted, got, want):
        compare(f"grad {names[i]}", a, b)
    if finite_differences:
        _finite_differences(layer, x)
    return errors


def _finite_differences(layer, x) -> None:
    names = [n for n, p in layer.named_parameters()]
    values = [p.detach().clone().requires_grad_() for p in layer.parameters()]

    def fn(x_, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps)), (x_,))

    if not torch.autograd.gradcheck(fn, (x.clone().requires_grad_(), *values)):
        raise AssertionError("torch.autograd.gradcheck failed")
