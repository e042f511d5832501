"""Activation: moe_fn's packed activation (``functional.swiglu_packed``: one Triton kernel
reading both halves in place on a GPU) against eager PyTorch on the halves, forward and
backward, per row of (token, k) rows. Bytes: the inputs read once and the outputs written
once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench import harness, shapes
from bench.checks import check, f64
from bench.harness import CLOCK
from bench.shapes import KERNEL_MODELS, names
from moe_fn import functional

ARMS = ("moe_fn", "torch")
# (activation, packing): Qwen3/Mixtral/DeepSeek's, and GPT-OSS's.
ACTS = ("swiglu-halves", "swiglu_oai-interleaved")
_inputs = harness.Latest()


def _make(model):
    n, i = model.rows, model.inter
    return (harness.randn(n, 2 * i, scale=3.0, seed=1).requires_grad_(),
            harness.randn(n, i, seed=2))


def _plain(gate_up, act):
    if act == "swiglu-halves":
        g, u = gate_up.chunk(2, dim=-1)
        return F.silu(g) * u
    g, u = gate_up[:, 0::2], gate_up[:, 1::2]
    gc, uc = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    return (uc + 1) * gc * torch.sigmoid(1.702 * gc)


def _forward(arm, gate_up, act):
    if arm == "torch":
        return _plain(gate_up, act)
    name, layout = act.split("-")
    return functional.swiglu_packed(gate_up, activation=name, layout=layout)


def _bytes(model, passes):
    return passes * model.rows * model.inter * torch.finfo(harness.dtype()).bits // 8


@pytest.mark.benchmark(group="activation fwd", timer=CLOCK)
@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("model", names(KERNEL_MODELS))
def test_activation_fwd(measure, model, act, arm):
    model = shapes.get(model)
    gate_up, _ = _inputs.get(model.name, lambda: _make(model))
    x = gate_up.detach()
    with torch.no_grad():
        check(_forward(arm, x, act), _plain(x, act), _plain(f64(x), act), arm)
        measure(lambda: _forward(arm, x, act), shape=f"{model.name} {act}",
                nbytes=_bytes(model, 3), flush_l2=True)  # read 2I, write I


@pytest.mark.benchmark(group="activation bwd", timer=CLOCK)
@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("model", names(KERNEL_MODELS))
def test_activation_bwd(measure, model, act, arm):
    model = shapes.get(model)
    gate_up, dh = _inputs.get(model.name, lambda: _make(model))
    h = _forward(arm, gate_up, act)
    g64, dh64 = f64(gate_up, dh)
    check(torch.autograd.grad(h, gate_up, dh, retain_graph=True)[0],
          torch.autograd.grad(_plain(gate_up, act), gate_up, dh)[0],
          torch.autograd.grad(_plain(g64, act), g64, dh64)[0], arm)
    measure(lambda: torch.autograd.grad(h, gate_up, dh, retain_graph=True),
            shape=f"{model.name} {act}", nbytes=_bytes(model, 5),  # read 2I + I, write 2I
            flush_l2=True)
