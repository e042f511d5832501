"""Load-balancing losses on router logits ``(T, E)`` and the aux-loss-free bias rule.

The probabilities the losses balance (Megatron-Core's ``compute_routing_scores_for_aux_loss``):
``p = softmax(logits)`` over the E experts for the ``"softmax"`` and ``"softmax_topk"``
routers; for ``"sigmoid"`` routers ``p = s / (sum_e s_e + 1e-20)`` with ``s = sigmoid(logits)``.
Computed in float32 (float64 stays float64). The counts ``c_e`` are of each token's top-k
experts by ``p`` (ties to the lower index; no score-correction bias, no expert groups).

Every loss here that balances probabilities is one form, ``L = sum_t w_t sum_e W[g(t), e]
p[t, e]``: the E-vector ``W`` of token t's group ``g(t)`` (groups are equal runs of
consecutive tokens) holds the counts times the normalisation, ``w_t`` an optional weight
per token. Megatron-Core's normalisation: ``f_e = c_e / (k T)`` (sums to 1), ``P_e =
mean_t p[t, e]``, ``L = E sum_e f_e P_e`` (1 when perfectly balanced):

- the Switch/GShard loss, one group: ``W = E c / (k T^2)``;
- the sequence-level loss (DeepSeek-V2/V3), one group per sequence of S tokens, the mean
  over the B sequences: ``W_b = E c_b / (k S^2 B)``.

The router z-loss (ST-MoE) is ``mean_t logsumexp(logits_t)^2``.

No host syncs; no in-place writes into inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .activations import compute_dtype
from .router import SCORE_FUNCS, sorted_topk

PROB_EPS = 1e-20


def balance_probs(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """The probabilities ``p (T, E)`` the losses balance, in the compute dtype."""
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    lg = logits.to(compute_dtype(logits.dtype))
    if score_func == "sigmoid":
        s = torch.sigmoid(lg)
        return s / (s.sum(dim=-1, keepdim=True) + PROB_EPS)
    return torch.softmax(lg, dim=-1)


def topk_counts(probs: torch.Tensor, top_k: int, groups: int = 1) -> torch.Tensor:
    """``(groups, E)`` int64: how often each expert is among a token's ``top_k`` largest
    ``probs``, per group of ``T / groups`` consecutive tokens."""
    t, e = probs.shape
    if groups < 1 or t % groups:
        raise ValueError(f"{t} tokens do not split into {groups} equal groups")
    idx = sorted_topk(probs, top_k)
    offset = (torch.arange(t, device=probs.device) // max(t // groups, 1)) * e
    flat = (idx + offset[:, None]).reshape(-1)
    # scatter_add into a fixed size: bincount would read the largest index on the host.
    counts = torch.zeros(groups * e, dtype=torch.int64, device=probs.device)
    return counts.scatter_add(0, flat, torch.ones_like(flat)).reshape(groups, e)


def switch_weights(counts: torch.Tensor, num_tokens, *, top_k: int, num_experts: int,
                   scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    """``(1, E)`` ``W = scale * E c / (k T^2)`` in ``dtype`` for the Switch/GShard loss of
    ``counts (E,)`` over ``num_tokens`` T (an int or a 0-dim tensor; T = 0 gives 0)."""
    w = counts.to(dtype) * (scale * num_experts / top_k)
    if isinstance(num_tokens, torch.Tensor):
        t = num_tokens.to(dtype).clamp(min=1)
        return (w / (t * t)).reshape(1, -1)
    return (w / max(num_tokens, 1) ** 2).reshape(1, -1)


def sequence_weights(counts: torch.Tensor, seq_len: int, *, top_k: int, num_experts: int,
                     dtype=torch.float32) -> torch.Tensor:
    """``(B, E)`` ``W_b = E c_b / (k S^2 B)`` in ``dtype`` for the sequence-level loss of
    the per-sequence ``counts (B, E)`` of B sequences of ``seq_len`` S tokens."""
    b = counts.shape[0]
    denom = top_k * max(seq_len, 1) ** 2 * max(b, 1)
    return counts.to(dtype) * (num_experts / denom)


class ProbBalanceRes(NamedTuple):
    """Residuals of :func:`prob_balance_fwd`: the logits, the group weights ``W (G, E)``,
    the per-token weights ``(T,)`` or None, and the score function."""

    logits: torch.Tensor
    weights: torch.Tensor
    token_weights: torch.Tensor | None
    score_func: str


def prob_balance_fwd(logits, weights, token_weights=None, *, score_func: str):
    """``L = sum_t w_t sum_e W[g(t), e] p[t, e]`` (0-dim, compute dtype) for ``logits
    (T, E)``, ``weights (G, E)`` (G divides T) and optional ``token_weights (T,)``."""
    t = logits.shape[0]
    p = balance_probs(logits, score_func)
    g = weights.shape[0]
    if t % g:
        raise ValueError(f"{t} tokens do not split into {g} equal groups")
    per_group = p.reshape(g, t // g, p.shape[1])
    if token_weights is not None:
        per_group = per_group * token_weights.to(p.dtype).reshape(g, t // g, 1)
    loss = (per_group.sum(dim=1) * weights.to(p.dtype)).sum()
    return loss, ProbBalanceRes(logits, weights, token_weights, score_func)


# dp[t, e] = dL W[g(t), e] w_t. softmax: dl = p (dp - <dp, p>); normalised sigmoid
# p = s / S: ds = (dp - <dp, p>) / S, dl = ds s (1 - s).
def prob_balance_bwd(res: ProbBalanceRes, d_loss) -> torch.Tensor:
    """``d_logits (T, E)`` in the logits' dtype."""
    logits, weights, tw, score_func = res
    t = logits.shape[0]
    cd = compute_dtype(logits.dtype)
    lg = logits.to(cd)
    g = weights.shape[0]
    dp = weights.to(cd).repeat_interleave(t // g if g else 0, dim=0)
    if tw is not None:
        dp = dp * tw.to(cd)[:, None]
    dp = dp * _scalar(d_loss, lg)
    if score_func == "sigmoid":
        s = torch.sigmoid(lg)
        denom = s.sum(dim=-1, keepdim=True) + PROB_EPS
        p = s / denom
        ds = (dp - (dp * p).sum(dim=-1, keepdim=True)) / denom
        dl = ds * s * (1 - s)
    else:
        p = torch.softmax(lg, dim=-1)
        dl = p * (dp - (dp * p).sum(dim=-1, keepdim=True))
    return dl.to(logits.dtype)


class ZLossRes(NamedTuple):
    """Residuals of :func:`z_loss_fwd`: the logits."""

    logits: torch.Tensor


def z_loss_fwd(logits):
    """``mean_t logsumexp(logits_t)^2`` (0-dim, compute dtype; 0 for no tokens)."""
    lse = torch.logsumexp(logits.to(compute_dtype(logits.dtype)), dim=-1)
    return (lse * lse).sum() / max(logits.shape[0], 1), ZLossRes(logits)


# d/dl_te of lse_t^2 / T = 2 lse_t softmax(l_t)_e / T.
def z_loss_bwd(res: ZLossRes, d_loss) -> torch.Tensor:
    """``d_logits (T, E)`` in the logits' dtype."""
    logits = res.logits
    lg = logits.to(compute_dtype(logits.dtype))
    lse = torch.logsumexp(lg, dim=-1, keepdim=True)
    scale = _scalar(d_loss, lg) * (2 / max(lg.shape[0], 1))
    return (torch.softmax(lg, dim=-1) * lse * scale).to(logits.dtype)


def _scalar(d, like: torch.Tensor):
    """A gradient factor as ``like`` multiplies by it: a Python number as is (no copy to
    the device), a tensor in ``like``'s dtype and device."""
    return d.to(like.dtype).to(like.device) if isinstance(d, torch.Tensor) else float(d)


def bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free step: ``b_e + rate * sign(mean(load) - load_e)`` for an
    integer ``load (E,)``, decided exactly (``sign(sum(load) - E load_e)``), in ``bias``'s
    dtype."""
    e = load.shape[-1]
    direction = torch.sign(load.sum(dim=-1, keepdim=True) - e * load)
    return bias + direction.to(bias.dtype) * rate
