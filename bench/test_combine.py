"""Combine: each token's k expert rows gathered back and summed (the local exchange's
combine), unweighted and weighted by the routing weights, and the weighted sum's backward:
moe_fn's gather-sum ops (one Triton pass on a GPU, float32 accumulation) against
``index_select`` + a sum over k in PyTorch. Rows are in a random expert order. Each arm's
result (the backward's: the row and weight gradients) is checked against plain PyTorch's and
its float64 twin's by the tolerance rule (``bench.checks``)."""

from __future__ import annotations

import pytest
import torch

import moe_fn.kernels as ops
from bench import checks, harness, shapes
from bench.checks import check, f64
from bench.harness import CLOCK
from bench.shapes import KERNEL_MODELS, names

ARMS = ("moe_fn", "torch")
_inputs = harness.Latest()


def _make(model):
    t, k, h = model.tokens, model.top_k, model.hidden
    dev = harness.device()
    rows = harness.randn(t * k, h, seed=1)
    index = torch.randperm(t * k, device=dev, generator=harness.generator(2))
    pos_to_row = torch.empty_like(index)
    pos_to_row[index] = torch.arange(t * k, device=dev)
    w = torch.rand(t * k, device=dev, generator=harness.generator(3))
    return rows, index, pos_to_row, w, harness.randn(t, h, seed=4)


def _plain_sum(rows, index, k, w=None):
    g = rows.index_select(0, index).view(-1, k, rows.shape[1])
    if w is not None:
        g = g * w.view(-1, k, 1).to(rows.dtype)
    return g.sum(dim=1)


def _bytes(model, row_passes, token_passes):
    es = torch.finfo(harness.dtype()).bits // 8
    return (row_passes * model.rows + token_passes * model.tokens) * model.hidden * es


@pytest.mark.benchmark(group="combine gather-sum", timer=CLOCK)
@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("model", names(KERNEL_MODELS))
def test_gather_sum(measure, model, weighted, arm):
    model = shapes.get(model)
    rows, index, _, w, _ = _inputs.get(model.name, lambda: _make(model))
    k = model.top_k
    ww = w if weighted else None
    if arm == "torch":
        def fn():
            return _plain_sum(rows, index, k, ww)
    elif weighted:
        def fn():
            return ops.weighted_gather_sum_fwd(rows, index, w, k)[0]
    else:
        def fn():
            return ops.gather_sum_fwd(rows, index, k)[0]
    check(fn(), _plain_sum(rows, index, k, ww), _plain_sum(f64(rows), index, k, f64(ww)), arm)
    measure(fn, shape=f"{model.name} {'weighted' if weighted else 'plain'}",
            nbytes=_bytes(model, 1, 1), flush_l2=True)  # read the rows, write the tokens


@pytest.mark.benchmark(group="combine weighted bwd", timer=CLOCK)
@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("model", names(KERNEL_MODELS))
def test_weighted_gather_sum_bwd(measure, model, arm):
    model = shapes.get(model)
    rows, index, pos_to_row, w, d_out = _inputs.get(model.name, lambda: _make(model))
    k = model.top_k
    if arm == "moe_fn":
        def fn():
            return ops.weighted_gather_sum_bwd(d_out, rows, pos_to_row, w, k)
    else:
        r, ww = rows.clone().requires_grad_(), w.clone().requires_grad_()
        out = _plain_sum(r, index, k, ww)

        def fn():
            return torch.autograd.grad(out, (r, ww), d_out, retain_graph=True)
    # Read the rows and the output gradient, write the row gradients.
    got = measure(fn, shape=model.name, nbytes=_bytes(model, 2, 1), flush_l2=True)
    if arm == "moe_fn":  # no split given: every row gradient in the first part
        lo, hi, d_w = got
        got = (torch.cat([lo, hi]), d_w)

    def sum_(r, ww):
        return _plain_sum(r, index, k, ww)
    # One round's gradients against autograd of plain PyTorch's sum and its float64 twin.
    checks.assert_rule(got, checks.value_and_grads(sum_, [rows, w], dy=d_out)[1:],
                       checks.value_and_grads(sum_, [rows, w], checks.F64, d_out)[1:],
                       ["d_rows", "d_weights"])
