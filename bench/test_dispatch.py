"""Dispatch: the layout of one call's routes (per-expert counts and offsets, the stable
permutation, its inverse and each sorted row's token: moe_fn's two Triton launches on a GPU)
against a stable ``argsort`` + ``bincount`` in PyTorch; and the gather of the tokens' rows
into expert order in a preallocated buffer (moe_fn's row kernel against ``index_select``)."""

from __future__ import annotations

import pytest
import torch

import moe_fn.kernels as ops
from bench import harness, plain, shapes
from bench.checks import check, f64
from bench.harness import CLOCK
from bench.shapes import KERNEL_MODELS, names

ARMS = ("moe_fn", "torch")
_inputs = harness.Latest()


def _make(model):
    t, e, k = model.tokens, model.experts, model.top_k
    scores = torch.rand(t, e, device=harness.device(), generator=harness.generator(1))
    topk_idx = scores.topk(k, dim=-1).indices
    tokens = plain.layout(topk_idx, e)[4]
    x = harness.randn(t, model.hidden, seed=2)
    return topk_idx, tokens, x, torch.empty(t * k, model.hidden, device=x.device,
                                            dtype=x.dtype)


@pytest.mark.benchmark(group="dispatch layout", timer=CLOCK)
@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("model", names(KERNEL_MODELS))
def test_layout(measure, model, arm):
    model = shapes.get(model)
    topk_idx, *_ = _inputs.get(model.name, lambda: _make(model))
    e = model.experts
    if arm == "moe_fn":
        def fn():
            return ops.layout_with_tokens(topk_idx, e)
    else:
        def fn():
            return plain.layout(topk_idx, e)
    # Integers: the same as plain PyTorch's, exactly.
    check(fn(), plain.layout(topk_idx, e), plain.layout(topk_idx, e), arm)
    # Read the indices, write the permutation, its inverse and the tokens (int64 each).
    measure(fn, shape=model.name, nbytes=4 * topk_idx.numel() * 8, flush_l2=True)


@pytest.mark.benchmark(group="dispatch gather", timer=CLOCK)
@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("model", names(KERNEL_MODELS))
def test_gather_rows(measure, model, arm):
    model = shapes.get(model)
    _, tokens, x, out = _inputs.get(model.name, lambda: _make(model))
    if arm == "moe_fn":
        def fn():
            return ops.gather_rows(x, tokens, out=out)
    else:
        def fn():
            return torch.index_select(x, 0, tokens, out=out)
    check(fn().clone(), torch.index_select(x, 0, tokens), torch.index_select(f64(x), 0, tokens),
          arm)
    measure(fn, shape=model.name, nbytes=2 * out.numel() * out.element_size(), flush_l2=True)
