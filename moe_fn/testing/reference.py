"""A dense reference MoE layer, written from the formulas alone.

Every expert runs on every token; a dense ``(T, E)`` matrix of routing weights, zero off
each token's chosen experts, combines them. The routing decision is a per-token Python
sort with the documented tie rule. Nothing here calls moe_fn's implementation
(``moe_fn.pure``, ``moe_fn.kernels``, the autograd shells): it reads a ``MoEConfig``'s
fields and plain torch, so its autograd is an oracle for the layer's gradients.

Every function computes in the dtype of its inputs: float64 inputs give the oracle;
the same inputs cast to float32 (or bfloat16) give "plain same-precision PyTorch" for the
tolerance rule (``moe_fn.testing.assert_close_to_ref``).

Semantics (the layer's documented contract; see ``MoEConfig``):

- logits ``= x @ W_router^T (+ router_bias)``; scores: ``softmax`` over the experts,
  ``sigmoid`` elementwise, or ``softmax_topk`` (the logits themselves; the weights are the
  softmax over the chosen k logits).
- choice ``= scores + score_correction_bias`` (the bias moves the choice, never the
  weights). Expert groups (``n_group > 1``): contiguous groups scored by the sum of their
  two largest choice values (``top2_sum``) or their largest (``max``); the ``topk_group``
  best groups stay eligible. Then the ``top_k`` largest eligible choice values, listed by
  descending value; ties go to the lower index (groups and experts alike).
- weights ``= scores[chosen]`` (``softmax_topk``: softmax of the chosen logits);
  ``norm_topk_prob``: ``w / (sum w + 1e-20)``; then ``* routed_scaling_factor``.
- expert e on a row r: ``down_e(act(gate_up_e(r) + b_gu_e)) + b_down_e`` with gate and
  up taken from the packed ``(2I,)`` output as ``gate_up_layout`` says (``halves``: gate
  ``[:I]``, up ``[I:]``; ``interleaved``: gate even, up odd entries).
- ``score_apply``: ``post`` weights each expert's output, ``pre`` its input row,
  ``activation`` the activation's output.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # read for its fields only
    from ..config import MoEConfig

# The activations' constants where a config leaves them None (GPT-OSS's values).
DEFAULT_ALPHA = 1.702
DEFAULT_LIMIT = 7.0
NORM_EPS = 1e-20


class MoEParams(NamedTuple):
    """Every tensor of an MoE layer holding all ``E`` experts (the layer's names).

    router_weight ``(E, H)``; gate_up_proj ``(E, 2I, H)`` packed per ``gate_up_layout``;
    down_proj ``(E, H, I)``; router_bias ``(E,)`` added to the logits; score_correction_bias
    ``(E,)`` added to the scores for the choice only; gate_up_proj_bias ``(E, 2I)`` packed as
    the weight; down_proj_bias ``(E, H)``. Biases are None where the config has none.
    """

    router_weight: torch.Tensor
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    router_bias: torch.Tensor | None = None
    score_correction_bias: torch.Tensor | None = None
    gate_up_proj_bias: torch.Tensor | None = None
    down_proj_bias: torch.Tensor | None = None


class Route(NamedTuple):
    """A routing decision.

    topk_idx ``(T, k)`` int64: the chosen experts, by descending choice value.
    topk_weight ``(T, k)``: their routing weights (differentiable in the logits).
    margin ``(T,)`` float64: the smallest non-zero gap between two choice values (or two
    group scores) that decides the row: adjacent entries among its ``k + 1`` best eligible
    experts, and the last kept group against the first dropped one. A computation whose
    rounding error in the choice values exceeds half of it may choose differently (and
    still be right for its precision); exact ties between identical inputs (gap 0) are
    decided by the tie rule in every precision, while an exact tie between values of other
    inputs (two groups' sums) gives margin 0. ``inf`` where nothing is decided by a gap;
    None for a given route.
    """

    topk_idx: torch.Tensor
    topk_weight: torch.Tensor
    margin: torch.Tensor | None


class MoEOutput(NamedTuple):
    """out ``(T, H)``; logits ``(T, E)``; route: the :class:`Route` taken."""

    out: torch.Tensor
    logits: torch.Tensor
    route: Route


def activation_constants(activation: str, alpha=None, limit=None) -> tuple[float, float]:
    """``(alpha, limit)`` an activation computes with (defaults where None)."""
    alpha = DEFAULT_ALPHA if alpha is None else float(alpha)
    limit = DEFAULT_LIMIT if limit is None else float(limit)
    return alpha, limit


def reference_activation(gate, up, activation: str = "swiglu", *, alpha=None, limit=None):
    """``act(gate, up)`` elementwise:

    - ``swiglu``: ``silu(g) * u``
    - ``swiglu_clamped``: ``silu(min(g, L)) * clamp(u, -L, L)``
    - ``swiglu_oai``: ``(clamp(u, -L, L) + 1) * g' * sigmoid(alpha * g')``, ``g' = min(g, L)``
    - ``geglu_tanh``: ``gelu_tanh(g) * u``

    ``L`` = ``limit`` (default 7), ``alpha`` default 1.702.
    """
    alpha, limit = activation_constants(activation, alpha, limit)
    if activation == "swiglu":
        return F.silu(gate) * up
    if activation == "geglu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    gc, uc = torch.clamp(gate, max=limit), torch.clamp(up, -limit, limit)
    if activation == "swiglu_clamped":
        return F.silu(gc) * uc
    if activation == "swiglu_oai":
        return (uc + 1) * gc * torch.sigmoid(alpha * gc)
    raise ValueError(f"unknown activation {activation!r}")


def split_gate_up(packed, layout: str = "halves"):
    """``(gate, up)`` from a tensor whose last dimension packs both (``2I``)."""
    if layout == "halves":
        i = packed.shape[-1] // 2
        return packed[..., :i], packed[..., i:]
    if layout == "interleaved":
        return packed[..., 0::2], packed[..., 1::2]
    raise ValueError(f"unknown gate_up_layout {layout!r}")


def _softmax(t):
    e = torch.exp(t - t.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def _scores(logits, score_func: str):
    if score_func == "softmax":
        return _softmax(logits)
    if score_func == "sigmoid":
        return torch.sigmoid(logits)
    if score_func == "softmax_topk":
        return logits
    raise ValueError(f"unknown score_func {score_func!r}")


def _descending(values, candidates):
    """``candidates`` ordered by descending value, ties by ascending index."""
    return sorted(candidates, key=lambda e: (-values[e], e))


def _smallest_gap(gaps) -> float:
    gaps = [g for g in gaps if g != 0]
    return min(gaps) if gaps else math.inf


def _gap(a: float, b: float, key_a, key_b) -> float:
    """The gap between two choice values; an exact tie counts as decided (gap 0, the tie
    rule) only between identical inputs, which every precision computes to the same bits.
    Equal values from other inputs (two groups' sums of other members) are a tie that
    another precision's rounding may break either way: no margin at all."""
    if a == b and key_a != key_b:
        return -math.inf
    return a - b


def _choose_row(c: list[float], keys: list, *, top_k, n_group, topk_group, group_score):
    """One token's chosen experts and its decision margin, from its choice values and the
    inputs each was computed from (``keys``)."""
    num_experts = len(c)
    eligible = range(num_experts)
    gaps = []
    if n_group > 1:
        per = num_experts // n_group
        gscore, gkey = [], []
        for g in range(n_group):
            members = _descending(c, range(g * per, (g + 1) * per))
            used = members[:2] if group_score == "top2_sum" else members[:1]
            gscore.append(sum(c[e] for e in used))
            gkey.append(tuple(keys[e] for e in used))
        groups = _descending(gscore, range(n_group))
        if topk_group < n_group:
            last, first_out = groups[topk_group - 1], groups[topk_group]
            gaps.append(_gap(gscore[last], gscore[first_out], gkey[last], gkey[first_out]))
        eligible = [e for g in sorted(groups[:topk_group]) for e in range(g * per, (g + 1) * per)]
    order = _descending(c, eligible)
    gaps += [_gap(c[order[j]], c[order[j + 1]], keys[order[j]], keys[order[j + 1]])
             for j in range(min(top_k, len(order) - 1))]
    if any(g == -math.inf for g in gaps):
        return order[:top_k], 0.0
    return order[:top_k], _smallest_gap(gaps)


def reference_route(logits, *, top_k: int, score_func: str = "softmax",
                    norm_topk_prob: bool = False, n_group: int = 1, topk_group: int = 1,
                    group_score: str = "top2_sum", routed_scaling_factor: float = 1.0,
                    score_correction_bias=None, topk_idx=None) -> Route:
    """Route ``logits (T, E)`` (see the module's docstring); differentiable in the logits.

    ``topk_idx`` given: the weights of those experts (a replayed route), no choice made.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (T, E), got shape {tuple(logits.shape)}")
    t, num_experts = logits.shape
    scores = _scores(logits, score_func)
    margin = None
    if topk_idx is None:
        choice = scores.detach()
        if score_correction_bias is not None:
            choice = choice + score_correction_bias.detach().to(choice.dtype)
        if torch.isnan(choice).any():
            raise ValueError("the reference routes finite or infinite choice values, not NaN")
        # What each choice value is computed from, within its row: its logit and bias.
        b = (score_correction_bias.detach().reshape(-1).tolist()
             if score_correction_bias is not None else [0.0] * num_experts)
        rows = [_choose_row(row, list(zip(lrow, b)), top_k=top_k, n_group=n_group,
                            topk_group=topk_group, group_score=group_score)
                for row, lrow in zip(choice.tolist(), logits.detach().tolist())]
        topk_idx = torch.tensor([r[0] for r in rows], dtype=torch.int64,
                                device=logits.device).reshape(t, top_k)
        margin = torch.tensor([r[1] for r in rows], dtype=torch.float64).reshape(t)
    raw = scores.gather(1, topk_idx)
    if score_func == "softmax_topk":
        raw = _softmax(raw)
    if norm_topk_prob:
        raw = raw / (raw.sum(dim=-1, keepdim=True) + NORM_EPS)
    return Route(topk_idx, raw * routed_scaling_factor, margin)


def reference_experts(x, gate_up_proj, down_proj, counts, *, activation: str = "swiglu",
                      layout: str = "halves", alpha=None, limit=None, weights=None,
                      gate_up_bias=None, down_bias=None):
    """The expert MLP on rows grouped by expert: rows ``[sum(counts[:e]), +counts[e])`` of
    ``x (N, H)`` go through expert e: ``down(act(gate_up(r) + b_gu) [* w]) + b_down``.

    ``counts``: a sequence of E ints summing to N; ``weights (N,)`` scales the activation's
    output (not the down bias); biases ``(E, 2I)`` and ``(E, H)`` or None. A loop over
    the experts.
    """
    outs, start = [], 0
    for e, c in enumerate(int(c) for c in counts):
        rows = x[start:start + c]
        gu = rows @ gate_up_proj[e].t()
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e]
        h = reference_activation(*split_gate_up(gu, layout), activation, alpha=alpha,
                                 limit=limit)
        if weights is not None:
            h = h * weights[start:start + c, None]
        y = h @ down_proj[e].t()
        if down_bias is not None:
            y = y + down_bias[e]
        outs.append(y)
        start += c
    if start != x.shape[0]:
        raise ValueError(f"counts sum to {start}, but x has {x.shape[0]} rows")
    if not outs:
        return x.new_zeros(x.shape[0], down_proj.shape[1])
    return torch.cat(outs, dim=0)


def reference_moe(x, params: MoEParams, config: MoEConfig, *, topk_idx=None,
                  fp8: bool = False, weights_dtype: torch.dtype | None = None) -> MoEOutput:
    """The MoE layer of ``config`` on ``x (..., H)`` with all experts in ``params``.

    Dense over experts: each expert's output for every token, combined with the dense
    routing weights. ``topk_idx`` replays a route. With ``fp8`` the experts' two GEMMs are
    ``moe_fn.testing.fp8.fp8_linear`` (the plain arm for ``expert_precision=
    'fp8_rowwise'``; its float64 oracle is the call without). ``weights_dtype``: the
    routing weights rounded to it where they are applied, and their gradient where it
    leaves them (an exchange that carries them in it: DeepEP's float32), everything else
    in ``x``'s dtype. Returns ``MoEOutput(out (..., H), logits (T, E), route)``.
    """
    c = config
    shape = x.shape
    x2 = x.reshape(-1, c.hidden_size)
    logits = x2 @ params.router_weight.t()
    if params.router_bias is not None:
        logits = logits + params.router_bias
    route = reference_route(logits, top_k=c.top_k, score_func=c.score_func,
                            norm_topk_prob=c.norm_topk_prob, n_group=c.n_group,
                            topk_group=c.topk_group, group_score=c.group_score,
                            routed_scaling_factor=c.routed_scaling_factor,
                            score_correction_bias=params.score_correction_bias,
                            topk_idx=topk_idx)
    t, e = logits.shape
    applied = route.topk_weight
    if weights_dtype is not None:
        applied = _RoundTrip.apply(applied, weights_dtype)
    dense_w = x2.new_zeros(t, e).scatter(1, route.topk_idx, applied.to(x2.dtype))
    chosen = x2.new_zeros(t, e).scatter(1, route.topk_idx, 1.0)
    rows = x2[:, None, :].expand(t, e, c.hidden_size)
    if c.score_apply == "pre":
        rows = rows * dense_w[:, :, None]
    gu = (_per_expert_fp8(rows, params.gate_up_proj) if fp8 else
          torch.einsum("teh,eoh->teo", rows, params.gate_up_proj))
    if params.gate_up_proj_bias is not None:
        gu = gu + params.gate_up_proj_bias
    h = reference_activation(*split_gate_up(gu, c.gate_up_layout), c.activation,
                             alpha=c.activation_alpha, limit=c.activation_limit)
    if c.score_apply == "activation":
        h = h * dense_w[:, :, None]
    y = (_per_expert_fp8(h, params.down_proj) if fp8 else
         torch.einsum("tei,ehi->teh", h, params.down_proj))
    if params.down_proj_bias is not None:
        y = y + params.down_proj_bias
    combine = dense_w if c.score_apply == "post" else chosen
    out = torch.einsum("te,teh->th", combine, y)
    return MoEOutput(out.reshape(shape), logits, route)


class _RoundTrip(torch.autograd.Function):
    """``t`` rounded to ``dtype`` and back; its gradient too."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = dtype
        return t.to(dtype).to(t.dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype).to(g.dtype), None


def _per_expert_fp8(rows, weight):
    """``rows (T, E, K)`` through expert e's ``weight[e] (N, K)`` as FP8 linears."""
    from .fp8 import fp8_linear

    return torch.stack([fp8_linear(rows[:, e], weight[e]) for e in range(weight.shape[0])],
                       dim=1)


def layer_params(layer) -> MoEParams:
    """The tensors of a single-rank ``MoELayer`` (its own parameters and buffers, so
    gradients of ``reference_moe`` reach their ``.grad``)."""
    r, ex = layer.router, layer.experts
    return MoEParams(r.weight, ex.gate_up_proj, ex.down_proj, r.bias,
                     r.e_score_correction_bias, ex.gate_up_proj_bias, ex.down_proj_bias)


def load_params(layer, params: MoEParams, rank: int | None = None) -> None:
    """Copy ``params`` (all experts) into ``layer``: the router's tensors whole, the
    experts of ``rank`` (default the layer's rank in its expert-parallel group)."""
    r, ex = layer.router, layer.experts
    rank = layer.ep_rank if rank is None else rank
    e_local = ex.gate_up_proj.shape[0]
    sl = slice(rank * e_local, (rank + 1) * e_local)
    pairs = [(r.weight, params.router_weight), (ex.gate_up_proj, params.gate_up_proj[sl]),
             (ex.down_proj, params.down_proj[sl]), (r.bias, params.router_bias),
             (r.e_score_correction_bias, params.score_correction_bias),
             (ex.gate_up_proj_bias, _slice(params.gate_up_proj_bias, sl)),
             (ex.down_proj_bias, _slice(params.down_proj_bias, sl))]
    with torch.no_grad():
        for dst, src in pairs:
            if (dst is None) != (src is None):
                raise ValueError("params and the layer disagree on which biases exist")
            if dst is not None:
                dst.copy_(src)


def _slice(t, sl):
    return None if t is None else t[sl]


def random_params(config: MoEConfig, *, generator=None, dtype=torch.float64,
                  router_std: float = 1.0, expert_std: float = 0.5,
                  choice_bias_std: float = 0.3) -> MoEParams:
    """Parameters with every bias the config has, drawn from ``generator``: a router whose
    logits spread across experts (decisive routes), experts of moderate gain, a choice bias
    large enough to change some choices."""
    c = config
    e, h, i = c.num_experts, c.hidden_size, c.intermediate_size

    def draw(*shape, std):
        return std * torch.randn(*shape, generator=generator, dtype=torch.float64)

    p = MoEParams(
        draw(e, h, std=router_std), draw(e, 2 * i, h, std=expert_std),
        draw(e, h, i, std=expert_std),
        draw(e, std=expert_std) if c.router_bias else None,
        draw(e, std=choice_bias_std) if c.score_correction_bias else None,
        draw(e, 2 * i, std=expert_std) if c.expert_bias else None,
        draw(e, h, std=expert_std) if c.expert_bias else None)
    return MoEParams(*(None if t is None else t.to(dtype) for t in p))
