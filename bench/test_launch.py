"""Host time per call (GPU only): moe_fn's fast Triton launch (``moe_fn.kernels._launch``)
against Triton's own launch path, per kernel wrapper (argument checks, output allocation
and the launch) and per layer forward and forward + backward (the Qwen3-30B-A3B layer,
8192 tokens). The GPU is kept busy (a sleep queued before each call), so the host never
waits for it and the clock reads host time alone. ``torch.add`` is the reference for one
plain PyTorch launch. Each case's results are checked once: the fast launch's equal Triton's
own launch's."""

from __future__ import annotations

import pytest
import torch

import moe_fn.kernels as ops
from bench import checks, harness
from bench.harness import HAS_CUDA, HOST_CLOCK
from bench.shapes import QWEN3
from moe_fn import MoELayer
from moe_fn.kernels import _launch

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="host time behind a busy GPU needs one")

# GPU cycles of sleep queued before each call: far longer than any call's host time.
BUSY_CYCLES = 40_000_000
KERNELS = ("gather_sum", "activation", "router", "dispatch layout")
LAYER = ("layer fwd", "layer fwd+bwd")
CASES = [(c, a) for c in (*KERNELS, *LAYER) for a in ("moe_fn", "triton")] + [
    ("torch.add", "torch")]
_inputs = harness.Latest()


def _make():
    dev, dt = "cuda", torch.bfloat16
    g = harness.generator(0)
    rows = torch.randn(256, 64, device=dev, generator=g).to(dt)
    cfg = QWEN3.config()
    layer = MoELayer(cfg, device=dev, dtype=dt)
    x = torch.randn(QWEN3.tokens, QWEN3.hidden, device=dev, generator=g).to(dt)
    return dict(rows=rows, index=torch.randint(0, 256, (512,), device=dev, generator=g),
                gate=torch.randn(64, 64, device=dev, generator=g).to(dt),
                logits=torch.randn(64, 128, device=dev, generator=g),
                idx=torch.randint(0, 128, (64, 8), device=dev, generator=g),
                layer=layer, x=x.requires_grad_(), dy=torch.randn_like(x))


def _call(case, d):
    if case == "gather_sum":
        return lambda: ops.gather_sum_fwd(d["rows"], d["index"], 2)
    if case == "activation":
        return lambda: ops.swiglu_fwd(d["gate"], d["gate"], None, act_id=0, alpha=1.702,
                                      limit=7.0)
    if case == "router":
        return lambda: ops.router_fwd(d["logits"], None, top_k=8)
    if case == "dispatch layout":
        return lambda: ops.layout(d["idx"], 128)
    if case == "torch.add":
        return lambda: d["rows"].add(d["rows"])
    layer, x, dy = d["layer"], d["x"], d["dy"]
    if case == "layer fwd":
        return lambda: layer(x)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x)
        out.backward(dy)
        return [out.detach(), x.grad, *(p.grad for p in layer.parameters())]
    return step


def _tensors(result):
    return [t for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]


def _check_launches(case, d):
    """The fast launch runs Triton's kernels with the same arguments: its results equal the
    Triton launch's, bit for bit (``torch.add``: equal to ``rows + rows``)."""
    if case == "torch.add":
        assert torch.equal(_call(case, d)(), d["rows"] + d["rows"])
        return
    got = [t.clone() for t in _tensors(_call(case, d)())]
    _launch.ENABLED = False
    try:
        want = _tensors(_call(case, d)())
    finally:
        _launch.ENABLED = True
    assert len(got) == len(want) > 0
    for n, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{case}: result {n} differs between the launches"


def _busy():
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)


@pytest.mark.parametrize("case,arm", CASES, ids=[f"{c}-{a}" for c, a in CASES])
@pytest.mark.benchmark(group="host time per call", timer=HOST_CLOCK)
def test_host_time(measure, case, arm):
    d = _inputs.get("all", _make)
    checks.once(case, lambda: _check_launches(case, d))
    fn = _call(case, d)
    _launch.ENABLED = arm != "triton"
    try:
        fn()  # compile and fill the launch caches
        measure(fn, shape=case, setup=_busy)
    finally:
        _launch.ENABLED = True
        torch.cuda.synchronize()
