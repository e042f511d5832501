"""Deliberately wrong changes to moe_fn, applied in-process, that the suite must catch.

Each takes ``patch(owner, name, value)`` (``setattr``, or a pytest ``MonkeyPatch``'s, which
undoes it). ``tests/test_mutations.py`` runs a few chosen tests under each, in its own
process, and asserts that they fail, and that they pass without one.
``MOE_FN_TEST_MUTATION=<name>`` in the environment applies one for good when ``tests`` is
imported (in pytest's process and in every process ``tests.dist_utils.run_distributed``
spawns, which import the test bodies from ``tests``): the whole suite under it.
"""

from __future__ import annotations

import os

import torch

ENV = "MOE_FN_TEST_MUTATION"


def _negated_output(patch):
    """The layer's output negated (its gradients follow)."""
    from moe_fn.layer import MoELayer

    real = MoELayer._forward

    def _forward(self, x, return_router_logits, seq_len=None):
        got = real(self, x, return_router_logits, seq_len)
        if return_router_logits:
            return -got[0], got[1]
        return -got
    patch(MoELayer, "_forward", _forward)


def _bf16_float32_path(patch):
    """A float32 input rounded to bfloat16 before the layer computes (a float32 layer
    whose data path is bfloat16)."""
    from moe_fn.layer import MoELayer

    real = MoELayer._forward

    def _forward(self, x, return_router_logits, seq_len=None):
        if x.dtype == torch.float32:
            x = x.to(torch.bfloat16).to(torch.float32)
        return real(self, x, return_router_logits, seq_len)
    patch(MoELayer, "_forward", _forward)


def _dropped_balance_term(patch):
    """The Switch (aux) loss's gradient left out of the balancing losses' backward (its
    value still reported)."""
    import attrs

    import moe_fn.autograd.balance as balance

    real = balance.terms_grad

    def terms_grad(terms, logits):
        return real(attrs.evolve(terms, switch=None), logits)
    patch(balance, "terms_grad", terms_grad)


def _nan_in_tolerance_input(patch):
    """One entry of a composite result NaN where the tolerance rule reads it: the first
    element of the first non-empty result of every ``assert_jointly_close_to_ref`` and
    ``assert_all_close_to_ref`` call (both take their entries from ``_triples``)."""
    import moe_fn.testing.tolerance as tol

    real = tol._triples

    def _triples(got, plain, ref64, names):
        got = list(got)
        for i, g in enumerate(got):
            if isinstance(g, torch.Tensor) and g.numel():
                g = g.clone()
                g.view(-1)[0] = float("nan")
                got[i] = g
                break
        return real(got, plain, ref64, names)
    patch(tol, "_triples", _triples)


def _lowest_experts_route(patch):
    """The router choosing the k experts of lowest logits, its weights computed on that
    route (a layer consistent with its wrong route)."""
    import moe_fn.kernels as kernels

    real = kernels.router_linear_fwd

    def router_linear_fwd(x, weight, lin_bias, bias, *, top_k, topk_idx=None, **kw):
        if topk_idx is None:
            logits = torch.nn.functional.linear(x, weight, lin_bias)
            topk_idx = logits.topk(top_k, dim=-1, largest=False).indices
        return real(x, weight, lin_bias, bias, top_k=top_k, topk_idx=topk_idx, **kw)
    patch(kernels, "router_linear_fwd", router_linear_fwd)


MUTATIONS = {
    "negated_output": _negated_output,
    "bf16_float32_path": _bf16_float32_path,
    "dropped_balance_term": _dropped_balance_term,
    "nan_in_tolerance_input": _nan_in_tolerance_input,
    "lowest_experts_route": _lowest_experts_route,
}


def apply_from_env() -> None:
    name = os.environ.get(ENV)
    if not name:
        return
    if name not in MUTATIONS:
        raise ValueError(f"{ENV}={name!r}: no such mutation; one of {sorted(MUTATIONS)}")
    MUTATIONS[name](setattr)
