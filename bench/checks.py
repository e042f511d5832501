"""Each benchmark's result, computed once outside the timing (also under
``--benchmark-disable``), checked against its group's reference by the tolerance rule
(``moe_fn.testing``): ``plain`` is the group's plain PyTorch arm in the benchmarks' dtype,
``ref64`` the same code on the same inputs in float64. Timing stays out of it."""

from __future__ import annotations

import torch

from moe_fn.testing import assert_all_close_to_ref, assert_close_to_ref


def f64(*ts):
    """Floating tensors as float64 leaves (requiring grad where the input did); others as
    they are."""
    out = []
    for t in ts:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.detach().double().requires_grad_(t.requires_grad)
        out.append(t)
    return out if len(out) > 1 else out[0]


def check(got, plain, ref64, what: str) -> None:
    """``got`` (a tensor or a sequence of them) by the rule against ``plain`` and ``ref64``;
    an integer result must equal ``plain`` exactly."""
    if isinstance(got, torch.Tensor):
        got, plain, ref64 = [got], [plain], [ref64]
    floats = [(g, p, r) for g, p, r in zip(got, plain, ref64, strict=True)
              if g is not None and g.is_floating_point()]
    for g, p in zip(got, plain, strict=True):
        if g is not None and not g.is_floating_point():
            assert torch.equal(g, p), f"{what}: an integer result differs from plain PyTorch's"
    if len(floats) == 1:
        assert_close_to_ref(*(t.detach() for t in floats[0]), what)
    elif floats:
        assert_all_close_to_ref(*([t.detach() for t in col] for col in zip(*floats)),
                                [f"{what}[{i}]" for i in range(len(floats))])


def stable_tokens(logits64, model, dtype, bias=None) -> torch.Tensor:
    """``(T,)`` bool: the tokens whose route no rounding of the logits in ``dtype`` can
    change (each logit moved by up to ``2 eps max|logit|``, twice a rounding at the token's
    largest logit): the k-th and next choice values, and with expert groups the chosen and
    next group's scores, further apart than their moves. An arm's output is compared with
    float64 there only; elsewhere a near tie may route either way at any precision."""
    tol = 2 * torch.finfo(dtype).eps * logits64.abs().amax(-1)
    r, k = model.routing, model.top_k
    if r.get("score_func", "softmax") == "softmax":
        v = logits64.sort(-1, descending=True).values
        return v[:, k - 1] - v[:, k] > 2 * tol
    c = torch.sigmoid(logits64)  # moves by at most a quarter of the logits'
    if bias is not None:  # the choice bias (the weights stay the scores)
        c = c + bias.double()
    t, e = c.shape
    g, tg = r["n_group"], r["topk_group"]
    groups = c.view(t, g, e // g).topk(2, dim=-1).values.sum(-1)
    ok = torch.ones(t, dtype=torch.bool, device=c.device)
    if tg < g:
        gv = groups.sort(-1, descending=True).values
        ok &= gv[:, tg - 1] - gv[:, tg] > 4 * tol
    keep = torch.zeros_like(groups).scatter_(1, groups.topk(tg, dim=-1).indices, 1.0)
    eligible = keep[:, :, None].expand(t, g, e // g).reshape(t, e) > 0
    v = c.masked_fill(~eligible, float("-inf")).sort(-1, descending=True).values
    return ok & (v[:, k - 1] - v[:, k] > 2 * tol)
