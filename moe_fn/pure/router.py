"""Token-choice top-k routing on router logits ``(T, E)``; the linear ``x @ W^T`` is the caller's.

Steps (DeepSeek-V3 / TorchTitan / AutoEP order):

1. ``scores`` in float32 (float64 stays float64):
   - ``"softmax"``: softmax over the E experts (Qwen3-MoE, Mixtral, DeepSeek-V2);
   - ``"sigmoid"``: elementwise sigmoid (DeepSeek-V3, GLM-4-MoE, MiniMax-M2);
   - ``"softmax_topk"``: no transform before the choice; the weights are the softmax over
     the k chosen logits (GPT-OSS: top-k on the logits, then softmax of the k values).
2. ``choice = scores + bias``: the score-correction bias ``(E,)`` moves the choice only,
   never the weights.
3. Expert groups (``n_group > 1``): the E experts form ``n_group`` contiguous groups; a
   group's score is the sum of its two largest choice scores (``"top2_sum"``, DeepSeek-V3)
   or its largest (``"max"``, DeepSeek-V2 ``group_limited_greedy``). The ``topk_group``
   best groups are kept; the other groups' experts are set to ``-inf``.
4. ``topk_idx``: the ``top_k`` largest choice scores.
5. ``topk_weight = scores[topk_idx]`` (unbiased); if ``norm_topk_prob``:
   ``w / (sum_k w + 1e-20)``; then ``* routed_scaling_factor``.

Tie rule (groups and experts alike): among equal choice scores the lower index wins, and
``topk_idx`` lists the chosen experts by descending choice score, ties by ascending index.
It is computed with ``torch.sort(descending=True, stable=True)``, which guarantees this on
every device. ``torch.topk`` does NOT: on CPU (torch 2.13) it picks an implementation-
defined member of a tie (``topk(zeros(1, 8), 1)`` returns index 6), and CUDA differs again.
So on inputs without ties our indices equal HF's (as sets; as lists where HF sorts), and on
ties our choice is the deterministic one. NaN logits sort as the largest, as in torch.sort.

Known deviations from the HF code, all on measure-zero inputs: HF's Qwen3/Mixtral/MiniMax
normalise without the ``1e-20``; DeepSeek-V2 masks dropped groups to ``0.0`` instead of
``-inf`` (differs only when a kept expert's probability underflows to exactly 0).

No host syncs; no in-place writes into inputs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._checks import FLOAT_DTYPES, check_same, check_tensor
from .activations import compute_dtype

SCORE_FUNCS = ("softmax", "sigmoid", "softmax_topk")
GROUP_SCORES = ("top2_sum", "max")
SCORE_ID = {name: i for i, name in enumerate(SCORE_FUNCS)}
NORM_EPS = 1e-20


class RouterRes(NamedTuple):
    """Residuals of :func:`router_fwd`.

    scores: ``(T, E)`` compute dtype, the softmax probabilities (``"softmax"`` only, the
        softmax backward needs every expert's probability); ``None`` otherwise.
    topk_idx: ``(T, k)`` int64, the chosen experts (distinct within a row).
    topk_raw: ``(T, k)`` compute dtype, the chosen scores before normalisation and scaling
        (``"softmax_topk"``: the softmax over the chosen logits).
    num_experts: E.
    score_id: index into ``SCORE_FUNCS``.
    norm: 1 if ``norm_topk_prob`` else 0.
    scale: ``routed_scaling_factor``.
    logits_dtype: dtype of the logits (the gradient's dtype).
    """

    scores: torch.Tensor | None
    topk_idx: torch.Tensor
    topk_raw: torch.Tensor
    num_experts: int
    score_id: int
    norm: int
    scale: float
    logits_dtype: torch.dtype


def router_validate(num_experts: int, *, top_k: int, score_func: str = "softmax",
                    norm_topk_prob: bool = False, n_group: int = 1, topk_group: int = 1,
                    group_score: str = "top2_sum", routed_scaling_factor: float = 1.0) -> None:
    """Raise ``ValueError`` (naming the argument and the fix) for static arguments that
    cannot route. ``MoEConfig`` runs it on its routing options at configuration time."""
    def _int(name, v, lo):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an int, got {v!r}")
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")

    _int("num_experts", num_experts, 1)
    _int("top_k", top_k, 1)
    _int("n_group", n_group, 1)
    _int("topk_group", topk_group, 1)
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {group_score!r}")
    if not isinstance(norm_topk_prob, bool):
        raise ValueError(f"norm_topk_prob must be a bool, got {norm_topk_prob!r}")
    if (isinstance(routed_scaling_factor, bool)
            or not isinstance(routed_scaling_factor, (int, float))
            or not math.isfinite(routed_scaling_factor) or routed_scaling_factor <= 0):
        raise ValueError(
            f"routed_scaling_factor must be a positive finite number, got {routed_scaling_factor!r}"
        )
    # The routing weights are float32 (float64 only for a float64 layer): a factor past
    # float32's range makes them inf (outputs inf/NaN) or exactly zero (outputs zero).
    f32 = torch.finfo(torch.float32)
    if not f32.tiny <= routed_scaling_factor <= f32.max:
        raise ValueError(
            f"routed_scaling_factor={routed_scaling_factor!r} lies outside float32's range "
            f"[{f32.tiny:.3g}, {f32.max:.3g}], the dtype of the routing weights it scales "
            "(they would become inf or zero): use a factor in that range (DeepSeek-V3's is 2.5)")
    if top_k > num_experts:
        raise ValueError(f"top_k ({top_k}) must not exceed num_experts ({num_experts})")
    if num_experts % n_group:
        raise ValueError(f"n_group ({n_group}) must divide num_experts ({num_experts}): use a "
                         f"divisor of {num_experts}, or n_group=1 for no expert groups")
    if topk_group > n_group:
        raise ValueError(f"topk_group ({topk_group}) must not exceed n_group ({n_group}): "
                         f"keep at most {n_group} groups")
    per_group = num_experts // n_group
    if n_group > 1:
        if top_k > topk_group * per_group:
            raise ValueError(
                f"top_k ({top_k}) exceeds the experts of the {topk_group} chosen groups "
                f"({topk_group} * {per_group}): raise topk_group or lower top_k")
        if group_score == "top2_sum" and per_group < 2:
            raise ValueError(
                f"group_score='top2_sum' needs at least 2 experts per group, got {per_group} "
                f"(n_group={n_group}, num_experts={num_experts}): use group_score='max'")


def check_router_args(logits, bias=None) -> None:
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    if bias is not None:
        check_router_bias(bias, logits, logits.shape[1])


def check_router_bias(bias, ref, num_experts: int) -> None:
    """The score-correction bias: float ``(E,)`` on ``ref``'s device."""
    check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES)
    if bias.shape[0] != num_experts:
        raise ValueError(f"bias must have one entry per expert ({num_experts}), "
                         f"got {bias.shape[0]}")
    check_same("logits and bias", ref, bias, dtype=False)


def check_replayed_route(topk_idx, num_tokens: int, top_k: int) -> None:
    if topk_idx.shape != (num_tokens, top_k) or topk_idx.dtype != torch.int64:
        raise ValueError(f"topk_idx must be int64 of shape {(num_tokens, top_k)}, got "
                         f"{topk_idx.dtype} {tuple(topk_idx.shape)}")


def sorted_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row: descending, ties to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True)[1][:, :k]


def _choose(scores, bias, *, top_k, n_group, topk_group, group_score):
    """The routing decision: top-k of the (biased) scores within the best groups."""
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    num_experts = scores.shape[1]
    if n_group > 1:
        t = choice.shape[0]
        per_group = num_experts // n_group
        grouped = choice.reshape(t, n_group, per_group)
        if group_score == "top2_sum":
            gscore = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            gscore = grouped.amax(dim=-1)
        keep_groups = sorted_topk(gscore, topk_group)
        keep = torch.zeros(t, n_group, dtype=torch.bool, device=scores.device)
        keep = keep.scatter(1, keep_groups, True)
        keep = keep[:, :, None].expand(t, n_group, per_group).reshape(t, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    return sorted_topk(choice, top_k)


def router_fwd(logits, bias=None, *, top_k: int, score_func: str = "softmax",
               norm_topk_prob: bool = False, n_group: int = 1, topk_group: int = 1,
               group_score: str = "top2_sum", routed_scaling_factor: float = 1.0,
               topk_idx=None):
    """Route ``logits (T, E)``; returns ``((topk_idx int64 (T, k), topk_weight (T, k)), res)``.

    ``topk_idx`` given (a replayed route): the choice is not made again; the weights are
    those of these experts, computed from ``logits`` as usual.

    ``topk_weight`` is float32 (float64 for float64 logits). ``bias (E,)`` is the
    score-correction bias (choice only; not differentiated).
    """
    check_router_args(logits, bias)
    num_experts = logits.shape[1]
    router_validate(num_experts, top_k=top_k, score_func=score_func,
                    norm_topk_prob=norm_topk_prob, n_group=n_group, topk_group=topk_group,
                    group_score=group_score, routed_scaling_factor=routed_scaling_factor)
    cd = compute_dtype(logits.dtype)
    lg = logits.to(cd)
    if score_func == "softmax":
        scores = torch.softmax(lg, dim=-1)
    elif score_func == "sigmoid":
        scores = torch.sigmoid(lg)
    else:
        scores = lg
    if topk_idx is None:
        topk_idx = _choose(scores, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                           group_score=group_score)
    else:
        check_replayed_route(topk_idx, logits.shape[0], top_k)
    raw = scores.gather(1, topk_idx)
    if score_func == "softmax_topk":
        raw = torch.softmax(raw, dim=-1)
    w = raw
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + NORM_EPS)
    w = w * routed_scaling_factor
    res = RouterRes(scores if score_func == "softmax" else None, topk_idx, raw, num_experts,
                    SCORE_ID[score_func], int(norm_topk_prob), float(routed_scaling_factor),
                    logits.dtype)
    return (topk_idx, w), res


class RouterLinearRes(NamedTuple):
    """Residuals of :func:`router_linear_fwd`: the linear's input and weight, whether it has
    a bias, and the routing's :class:`RouterRes`."""

    x: torch.Tensor
    weight: torch.Tensor
    has_lin_bias: bool
    route: RouterRes


def router_linear_fwd(x, weight, lin_bias=None, bias=None, *, top_k: int,
                      score_func: str = "softmax", norm_topk_prob: bool = False,
                      n_group: int = 1, topk_group: int = 1, group_score: str = "top2_sum",
                      routed_scaling_factor: float = 1.0, topk_idx=None, route_impl=None):
    """The router's linear ``logits = x @ weight^T (+ lin_bias)``, then :func:`router_fwd`
    on the logits (``route_impl.router_fwd`` when given: ``moe_fn.kernels`` for its kernel).
    Returns ``(logits, (topk_idx, topk_weight), RouterLinearRes)``."""
    logits = torch.nn.functional.linear(x, weight, lin_bias)
    route = router_fwd if route_impl is None else route_impl.router_fwd
    (idx, w), res = route(logits, bias, top_k=top_k, score_func=score_func,
                          norm_topk_prob=norm_topk_prob, n_group=n_group,
                          topk_group=topk_group, group_score=group_score,
                          routed_scaling_factor=routed_scaling_factor, topk_idx=topk_idx)
    return logits, (idx, w), RouterLinearRes(x, weight, lin_bias is not None, res)


def router_linear_bwd(res: RouterLinearRes, d_logits, d_topk_weight, *,
                      needs=(True, True, True)):
    """``(dx, d_weight, d_lin_bias)`` from the logits' own gradient (an auxiliary loss; None
    when they have none) and the routing weights' (None likewise); None where ``needs``
    says it is not wanted or there is no bias. Torch ops only, so a gradient reaching just
    the logits can itself be differentiated."""
    g = d_logits
    if d_topk_weight is not None:
        g_w = router_bwd(res.route, d_topk_weight)
        g = g_w if g is None else g_w + g
    if g is None:
        return None, None, None
    dx = g.mm(res.weight) if needs[0] else None
    d_weight = g.t().mm(res.x) if needs[1] else None
    d_lin_bias = g.sum(0) if res.has_lin_bias and needs[2] else None
    return dx, d_weight, d_lin_bias


# w = c * n(r), n(r)_j = r_j / (S + eps), S = sum r:  dr_j = (dn_j - sum_i dn_i n_i) / (S + eps);
# r = s[idx]: softmax ds -> dl = s * (ds - <ds, s>); sigmoid dl = ds * s(1-s); softmax_topk on k.
def router_bwd(res: RouterRes, d_topk_weight):
    """Returns ``d_logits (T, E)`` in the logits' dtype (zero off the chosen experts, except
    through the softmax, which couples every expert)."""
    raw = res.topk_raw
    cd = raw.dtype
    dr = d_topk_weight.to(cd) * res.scale
    if res.norm:
        denom = raw.sum(dim=-1, keepdim=True) + NORM_EPS
        n = raw / denom
        dr = (dr - (dr * n).sum(dim=-1, keepdim=True)) / denom
    t = raw.shape[0]
    if res.score_id == SCORE_ID["softmax"]:
        s = res.scores
        ds = torch.zeros(t, res.num_experts, dtype=cd, device=raw.device)
        ds = ds.scatter(1, res.topk_idx, dr)
        dl = s * (ds - (dr * raw).sum(dim=-1, keepdim=True))
    else:
        if res.score_id == SCORE_ID["sigmoid"]:
            dsel = dr * raw * (1 - raw)
        else:
            dsel = raw * (dr - (dr * raw).sum(dim=-1, keepdim=True))
        dl = torch.zeros(t, res.num_experts, dtype=cd, device=raw.device)
        dl = dl.scatter(1, res.topk_idx, dsel)
    return dl.to(res.logits_dtype)
