"""The checkpointed layer: ``h + layer(h)`` inside an activation checkpoint, forward +
backward (which recomputes the forward). Arms: ``unchecked`` (no checkpoint: the lower
bound), ``torch`` (``torch.utils.checkpoint``, reentrant: the recompute routes and lays
out again), ``moe_fn`` (``moe_fn.checkpoint``: the recompute replays the forward's route
and dispatch layout) and ``moe_fn-skip`` (also ``skip_recompute_combine``: the recompute
leaves out the combine its output would only feed into the discarded residual add). FLOPs:
as computed, 2 T k H 3I per forward (recompute included), twice that backward. Each arm's
output and gradients are checked once against float64 (``bench.checks``)."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import moe_fn
from bench import checks, harness, shapes
from bench.harness import CLOCK
from bench.shapes import CHECKPOINT_MODELS, SKIP, layer_flops, names
from moe_fn import MoELayer

ARMS = ("unchecked", "torch", "moe_fn", "moe_fn-skip")
_inputs = harness.Latest()


def _make(model):
    dev, dt = harness.device(), harness.dtype()
    layers = {}
    for name, options in (("plain", {}), ("skip", SKIP)):
        torch.manual_seed(0)  # the same weights in both
        layers[name] = MoELayer(model.config(**options), device=dev, dtype=dt)
    x = harness.randn(model.tokens, model.hidden, seed=1).requires_grad_()
    return layers, x, harness.randn(model.tokens, model.hidden, seed=2)


@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("model", names(CHECKPOINT_MODELS))
@pytest.mark.benchmark(group="checkpointed layer fwd+bwd", timer=CLOCK)
def test_checkpointed_layer(measure, model, arm):
    model = shapes.get(model)
    layers, x, dy = _inputs.get(model.name, lambda: _make(model))
    layer = layers["skip" if arm == "moe_fn-skip" else "plain"]

    def block(h):
        return h + layer(h)

    run = {"unchecked": block,
           "torch": lambda h: torch_checkpoint.checkpoint(block, h, use_reentrant=True),
           "moe_fn": lambda h: moe_fn.checkpoint(block, h),
           "moe_fn-skip": lambda h: moe_fn.checkpoint(block, h)}[arm]

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = run(x)
        out.backward(dy)
        return [out.detach(), x.grad, layer.router.weight.grad,
                layer.experts.gate_up_proj.grad, layer.experts.down_proj.grad]

    passes = 3 if arm == "unchecked" else 4
    got = measure(step, shape=model.name, flops=passes * layer_flops(model),
                  info={"tokens": model.tokens})
    if arm == "moe_fn-skip":
        assert layer.exchange.counters["combine_skipped"] > 0
    # The route against float64's where no rounding can change it; one round's output and
    # gradients against float64 formulas on the layer's route.
    weights = [p.detach() for p in (layer.router.weight, layer.experts.gate_up_proj,
                                    layer.experts.down_proj)]

    def check():
        with torch.no_grad():
            idx = layer.route(x.detach())[1]
        checks.assert_route(arm, idx, *checks.stable_route(x, weights[0], model))
        checks.check_layer(arm, got, idx, weights, checks.plain_layer(model), model,
                           x.detach(), dy, residual=True,
                           memo_key=("checkpointed layer", model.name))
    checks.once((model.name, arm), check)
