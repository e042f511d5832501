"""Balancing losses' pairs against float64 autograd of naive per-token code; the bias rule
against its definition."""

from __future__ import annotations

import math

import pytest
import torch

from moe_fn.pure.balance import (
    ProbBalanceRes,
    ZLossRes,
    balance_probs,
    bias_update,
    prob_balance_bwd,
    prob_balance_fwd,
    sequence_weights,
    switch_weights,
    topk_counts,
    z_loss_bwd,
    z_loss_fwd,
)

# ----------------------------------------------------------------------------- oracles


def naive_probs(logits, score_func):
    if score_func == "sigmoid":
        s = torch.sigmoid(logits)
        return s / (s.sum(-1, keepdim=True) + 1e-20)
    return torch.softmax(logits, -1)


def naive_counts(p, k):
    """Per-token Python loops: the k largest, ties to the lower index."""
    t, e = p.shape
    counts = [0] * e
    for row in p.tolist():
        for j in sorted(range(e), key=lambda i: (-row[i], i))[:k]:
            counts[j] += 1
    return torch.tensor(counts, dtype=torch.float64)


def naive_switch(logits, k, score_func, counts=None, tokens=None):
    """E * sum_e f_e P_e with f_e = c_e / (k T) and P_e the mean probability (the counts and
    T given for a loss whose counts cover more tokens than ``logits``)."""
    p = naive_probs(logits, score_func)
    e = logits.shape[1]
    tokens = logits.shape[0] if tokens is None else tokens
    counts = naive_counts(p.detach(), k) if counts is None else counts
    if tokens == 0:
        return logits.sum() * 0
    f = counts / (k * tokens)
    big_p = p.sum(0) / tokens
    return e * (f * big_p).sum()


def naive_sequence(logits, k, score_func, seq_len):
    """The mean over sequences of each sequence's Switch loss."""
    t = logits.shape[0]
    if t == 0:
        return logits.sum() * 0
    losses = [naive_switch(logits[s:s + seq_len], k, score_func) for s in range(0, t, seq_len)]
    return sum(losses) / len(losses)


def naive_z(logits):
    if logits.shape[0] == 0:
        return logits.sum() * 0
    return (torch.logsumexp(logits, -1) ** 2).mean()


def _logits(t, e, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(t, e, generator=g, dtype=torch.float64)).requires_grad_()


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid", "softmax_topk"])
@pytest.mark.parametrize("t,e,k", [(12, 6, 2), (7, 8, 3), (0, 4, 1), (5, 4, 4)])
def test_switch_loss_and_gradient_match_the_naive_loss(score_func, t, e, k):
    logits = _logits(t, e, seed=t)
    p = balance_probs(logits.detach(), score_func)
    counts = topk_counts(p, k)[0]
    torch.testing.assert_close(counts.double(), naive_counts(p, k))
    w = switch_weights(counts, t, top_k=k, num_experts=e, dtype=torch.float64)
    got, res = prob_balance_fwd(logits.detach(), w, score_func=score_func)
    want = naive_switch(logits, k, "sigmoid" if score_func == "sigmoid" else "softmax")
    torch.testing.assert_close(got, want.detach())
    d = torch.tensor(0.7, dtype=torch.float64)
    (want * d).backward()
    torch.testing.assert_close(prob_balance_bwd(res, d), logits.grad)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("b,s", [(3, 5), (1, 7), (4, 1)])
def test_sequence_loss_and_gradient_match_the_naive_loss(score_func, b, s):
    k, e = 2, 6
    logits = _logits(b * s, e, seed=b + 10 * s)
    p = balance_probs(logits.detach(), score_func)
    counts = topk_counts(p, k, groups=b)
    for i in range(b):
        torch.testing.assert_close(counts[i].double(), naive_counts(p[i * s:(i + 1) * s], k))
    w = sequence_weights(counts, s, top_k=k, num_experts=e, dtype=torch.float64)
    got, res = prob_balance_fwd(logits.detach(), w, score_func=score_func)
    want = naive_sequence(logits, k, score_func, s)
    torch.testing.assert_close(got, want.detach())
    want.backward()
    torch.testing.assert_close(prob_balance_bwd(res, 1.0), logits.grad)


def test_token_weights_weight_each_tokens_term():
    logits = _logits(6, 4, seed=3)
    w = torch.rand(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    tw = torch.tensor([1.0, 0.0, 1.0, 0.5, 1.0, 0.0], dtype=torch.float64)
    got, res = prob_balance_fwd(logits.detach(), w, tw, score_func="softmax")
    p = torch.softmax(logits, -1)
    want = sum(tw[t] * (w[t // 3] * p[t]).sum() for t in range(6))
    torch.testing.assert_close(got, want.detach())
    want.backward()
    torch.testing.assert_close(prob_balance_bwd(res, 1.0), logits.grad)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_prob_balance_gradcheck(score_func):
    w = torch.rand(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, lg):
            loss, ctx.res = prob_balance_fwd(lg, w, score_func=score_func)
            return loss

        @staticmethod
        def backward(ctx, d):
            return prob_balance_bwd(ctx.res, d)

    assert torch.autograd.gradcheck(F.apply, (_logits(6, 5, seed=4),))


@pytest.mark.parametrize("t", [9, 0])
def test_z_loss_and_gradient_match_the_naive_loss(t):
    logits = _logits(t, 5, seed=5, scale=4.0)
    got, res = z_loss_fwd(logits.detach())
    want = naive_z(logits)
    torch.testing.assert_close(got, want.detach())
    want.backward()
    torch.testing.assert_close(z_loss_bwd(res, 1.0), logits.grad)
    assert isinstance(res, ZLossRes)


def test_lower_precision_logits_get_float32_probabilities_and_their_gradient_dtype():
    logits = _logits(8, 4).detach().to(torch.bfloat16)
    assert balance_probs(logits, "softmax").dtype == torch.float32
    w = torch.ones(1, 4)
    loss, res = prob_balance_fwd(logits, w, score_func="softmax")
    assert loss.dtype == torch.float32
    assert prob_balance_bwd(res, 1.0).dtype == torch.bfloat16
    assert isinstance(res, ProbBalanceRes)


def test_counts_break_ties_by_the_lower_index():
    p = torch.full((3, 5), 0.2)
    assert topk_counts(p, 2)[0].tolist() == [3, 3, 0, 0, 0]


def test_groups_must_split_the_tokens():
    with pytest.raises(ValueError, match="equal groups"):
        topk_counts(torch.rand(5, 3), 1, groups=2)


def test_bias_update_moves_each_bias_towards_the_mean_load():
    bias = torch.tensor([0.5, -0.25, 0.0, 1.0])
    load = torch.tensor([3, 5, 4, 0])  # mean 3: above, at (3 vs 3), below...
    got = bias_update(bias, load, 0.125)
    want = []
    mean = sum(load.tolist()) / 4
    for b, n in zip(bias.tolist(), load.tolist()):
        want.append(b + 0.125 * (0.0 if n == mean else math.copysign(1.0, mean - n)))
    assert got.tolist() == want
    assert got.dtype == torch.float32
