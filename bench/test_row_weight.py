"""Row weighting: ``rows * w[:, None]`` with moe_fn's ``functional.row_weight`` (one Triton
kernel on a GPU, float32 math) against eager PyTorch (the weights cast to the rows' dtype,
as Hugging Face does), forward and backward, on the (token, k) rows of one call."""

from __future__ import annotations

import pytest
import torch

from bench import harness, shapes
from bench.checks import check, f64
from bench.harness import CLOCK
from bench.shapes import KERNEL_MODELS, names
from moe_fn import functional

ARMS = ("moe_fn", "torch")
_inputs = harness.Latest()


def _make(model):
    n, h = model.rows, model.hidden
    rows = harness.randn(n, h, seed=1).requires_grad_()
    w = torch.rand(n, device=harness.device(), generator=harness.generator(2)).requires_grad_()
    return rows, w, harness.randn(n, h, seed=3)


def _forward(arm, rows, w):
    if arm == "moe_fn":
        return functional.row_weight(rows, w)
    return rows * w.to(rows.dtype)[:, None]


def _bytes(model, row_passes):
    es = torch.finfo(harness.dtype()).bits // 8
    return row_passes * model.rows * model.hidden * es + 4 * model.rows


@pytest.mark.benchmark(group="row weighting fwd", timer=CLOCK)
@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("model", names(KERNEL_MODELS))
def test_row_weight_fwd(measure, model, arm):
    model = shapes.get(model)
    rows, w, _ = _inputs.get(model.name, lambda: _make(model))
    r, ww = rows.detach(), w.detach()
    with torch.no_grad():
        check(_forward(arm, r, ww), _forward("torch", r, ww),
              _forward("torch", *f64(r, ww)), arm)
        measure(lambda: _forward(arm, r, ww), shape=model.name, nbytes=_bytes(model, 2),
                flush_l2=True)


@pytest.mark.benchmark(group="row weighting bwd", timer=CLOCK)
@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("model", names(KERNEL_MODELS))
def test_row_weight_bwd(measure, model, arm):
    model = shapes.get(model)
    rows, w, d = _inputs.get(model.name, lambda: _make(model))
    out = _forward(arm, rows, w)
    r64, w64, d64 = f64(rows, w, d)
    check(torch.autograd.grad(out, (rows, w), d, retain_graph=True),
          torch.autograd.grad(_forward("torch", rows, w), (rows, w), d),
          torch.autograd.grad(_forward("torch", r64, w64), (r64, w64), d64), arm)
    # Read rows and d_out, write d_rows (and the weights' gradient).
    measure(lambda: torch.autograd.grad(out, (rows, w), d, retain_graph=True),
            shape=model.name, nbytes=_bytes(model, 3), flush_l2=True)
