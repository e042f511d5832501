"""The MoE layer, forward and forward + backward, on one GPU (the local exchange).

Arms, all holding the same weights: moe_fn's ``MoELayer`` with the default config and with
the reference path (``impl="reference"``, ``shapes.MOE_FN_ARMS``), transformers'
``Qwen3MoeSparseMoeBlock`` with ``grouped_mm`` experts (where its softmax routing is the
model's), and a plain PyTorch layer (``plain.PlainLayer``). The forward runs with autograd
on, as in training, from an idle GPU (its host time before the first GEMM included);
forward + backward resets the gradients to None first. FLOPs: 2 T k H 3I forward, three
times that forward + backward. ``max_rel_diff_vs_torch``: the output against the plain
layer's, relative to its largest entry. Each arm's route, output and gradients are checked
once against float64 (``check_arm``).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from bench import checks, harness, plain, shapes
from bench.harness import CLOCK
from bench.shapes import LAYER_MODELS, MOE_FN_ARMS, layer_flops
from moe_fn import MoELayer

_layers = harness.Latest()
_inputs = harness.Latest()


def arms(model) -> list[str]:
    extra = ["transformers"] if plain.hf_applies(model) else []
    return [*MOE_FN_ARMS, *extra, "torch"]


CASES = [(m.name, arm) for m in LAYER_MODELS for arm in arms(m)]
# The headline shape (Qwen3-30B-A3B at 8192 tokens; on a CPU the first small one), for the
# pipelined forward and the paired default / reference comparison.
PAIRED_MODELS = [m.name for m in LAYER_MODELS if m.tokens == 8192 or not harness.HAS_CUDA][:1]


def build_weights(model):
    """Every arm of ``model``'s layer over one set of weights."""
    dev, dt = harness.device(), harness.dtype()
    h, i, e = model.hidden, model.inter, model.experts
    router = harness.randn(e, h, scale=0.02, seed=1)
    gate_up = harness.randn(e, 2 * i, h, scale=0.02, seed=2)
    down = harness.randn(e, h, i, scale=0.02, seed=3)
    fns, params, grads, routes = {}, {}, {}, {}
    for arm, options in MOE_FN_ARMS.items():
        layer = MoELayer(model.config(**options), device=dev, dtype=dt)
        with torch.no_grad():
            layer.router.weight.copy_(router)
            layer.experts.gate_up_proj.copy_(gate_up)
            layer.experts.down_proj.copy_(down)
        fns[arm], params[arm] = layer, list(layer.parameters())
        grads[arm] = lambda lay=layer: [lay.router.weight.grad, lay.experts.gate_up_proj.grad,
                                        lay.experts.down_proj.grad]
        routes[arm] = lambda x, lay=layer: lay.route(x)[1]
    if plain.hf_applies(model):
        fns["transformers"] = hf = plain.hf_block(model, router, gate_up, down)
        block = hf.module
        params["transformers"] = list(block.parameters())
        grads["transformers"] = lambda: [block.gate.weight.grad, block.experts.gate_up_proj.grad,
                                         block.experts.down_proj.grad]
        routes["transformers"] = lambda x: block.gate(x)[2]
    bias = (torch.zeros(e, device=dev) if model.routing.get("score_correction_bias")
            else None)
    fns["torch"] = lay = plain.PlainLayer(model, router, gate_up, down, bias)
    params["torch"] = list(lay.parameters())
    grads["torch"] = lambda: [lay.router.grad, torch.cat([lay.w_gate.grad, lay.w_up.grad], 1),
                              lay.w_down.grad]
    routes["torch"] = lambda x: checks.linear_route(x, lay.router, model, bias)
    return dict(fns=fns, params=params, grads=grads, routes=routes,
                weights=(router, gate_up, down), plain_arm=checks.plain_layer(model, bias))


def results(d, arm, backward):
    """``fn() -> the arm's results`` (``bench.checks.check_layer``'s ``got``): its output,
    with ``backward`` after resetting the gradients to None and backpropagating ``dy``."""
    fn, x, dy, leaves = d["fns"][arm], d["x"], d["dy"], d["params"][arm]
    if not backward:
        return lambda: [fn(x)]

    def step():
        for p in leaves:
            p.grad = None
        x.grad = None
        out = fn(x)
        out.backward(dy)
        return [out.detach(), x.grad, *d["grads"][arm]()]
    return step


def check_arm(model, d, arm, got):
    """The arm's results ``got`` (``results``; one benchmark round's), once per process: its
    route on the tokens no rounding of the logits can reroute (``checks.stable_tokens``) as
    float64's, and its output and gradients against the float64 formulas on its own route
    (``bench.checks.check_layer``)."""
    def run():
        x = d["x"].detach()
        with torch.no_grad():
            idx = d["routes"][arm](x)
        checks.assert_route(arm, idx, d["stable"], d["route64"])
        fp8 = MOE_FN_ARMS.get(arm, {}).get("expert_precision") is not None
        checks.check_layer(arm, [t.detach() for t in got], idx, d["weights"], d["plain_arm"],
                           model, x, d["dy"], fp8=fp8, memo_key=("layer", model.name))
    checks.once((model.name, arm, len(got) > 1), run)


def inputs(model, d):
    """An input, its output gradient, the plain layer's output, and the float64 route (each
    token's experts in order) with the tokens no rounding of the logits can reroute."""
    x = harness.randn(model.tokens, model.hidden, seed=4).requires_grad_()
    with torch.no_grad():
        ref = d["fns"]["torch"](x).float()
        stable, route64 = checks.stable_route(x, d["weights"][0], model)
    return dict(x=x, dy=harness.randn(model.tokens, model.hidden, seed=5), ref=ref,
                stable=stable, route64=route64)


def rel_diff(out, ref) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("phase", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("model,arm", CASES, ids=[f"{m}-{a}" for m, a in CASES])
@pytest.mark.benchmark(group="layer", timer=CLOCK)
def test_layer(measure, benchmark, model, arm, phase):
    model = shapes.get(model)
    d = _layers.get(model.weights_key, lambda: build_weights(model))
    d = _inputs.get(model.name, lambda: dict(d, **inputs(model, d)))
    backward = phase == "fwd+bwd"
    flops = layer_flops(model)
    got = measure(results(d, arm, backward), shape=f"{model.name} {phase}",
                  flops=3 * flops if backward else flops,
                  info={"tokens": model.tokens, "options": MOE_FN_ARMS.get(arm)})
    benchmark.extra_info["max_rel_diff_vs_torch"] = rel_diff(got[0].detach(), d["ref"])
    check_arm(model, d, arm, got)


PIPELINE = 8


@pytest.mark.parametrize("model,arm", [c for c in CASES if c[0] in PAIRED_MODELS],
                         ids=[f"{m}-{a}" for m, a in CASES if m in PAIRED_MODELS])
@pytest.mark.benchmark(group="layer fwd x8", timer=CLOCK)
def test_layer_pipelined(measure, benchmark, model, arm):
    """Eight forwards queued back to back, as in a training step where earlier kernels are
    still running: host time before a forward's first GEMM hides behind the GPU's work.
    ``per_forward_ms``: the median over eight."""
    model = shapes.get(model)
    d = _layers.get(model.weights_key, lambda: build_weights(model))
    d = _inputs.get(model.name, lambda: dict(d, **inputs(model, d)))
    fn, x = d["fns"][arm], d["x"]

    def forwards():
        for _ in range(PIPELINE - 1):
            fn(x)
        return [fn(x)]
    got = measure(forwards, shape=f"{model.name} fwd x{PIPELINE}",
                  flops=PIPELINE * layer_flops(model), info={"tokens": model.tokens})
    check_arm(model, d, arm, got)
    if benchmark.stats is not None and benchmark.stats.stats.data:
        benchmark.extra_info["per_forward_ms"] = benchmark.stats.stats.median / PIPELINE * 1e3


class _Paired:
    """Times two calls in each round, each from an idle device, in alternating order, so
    that the ratio of their times is paired round by round (drift of a shared machine
    cancels); the benchmark's own time is the pair's."""

    def __init__(self, first, second):
        self.fns, self.times, self.calls = (first, second), ([], []), 0
        self.last = [None, None]  # each call's latest result

    def _time(self, i) -> float:
        if not harness.HAS_CUDA:
            t0 = time.perf_counter()
            self.last[i] = self.fns[i]()
            return time.perf_counter() - t0
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        self.last[i] = self.fns[i]()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def __call__(self):
        order = (0, 1) if self.calls % 2 == 0 else (1, 0)
        self.calls += 1
        for i in order:
            self.times[i].append(self._time(i))

    def ratio(self, skip: int) -> float:
        """Median over the rounds after the first ``skip`` of first time / second time."""
        return statistics.median(a / b for a, b in zip(*(t[skip:] for t in self.times)))


def _paired(measure, benchmark, model, phase, first, second):
    model = shapes.get(model)
    d = _layers.get(model.weights_key, lambda: build_weights(model))
    d = _inputs.get(model.name, lambda: dict(d, **inputs(model, d)))
    backward = phase == "fwd+bwd"
    pair = _Paired(results(d, first, backward), results(d, second, backward))
    flops = layer_flops(model) * (3 if phase == "fwd+bwd" else 1)
    measure(pair, shape=f"{model.name} {phase}", flops=2 * flops,
            info={"tokens": model.tokens, "pair": [first, second]})
    for arm, got in zip((first, second), pair.last):
        check_arm(model, d, arm, got)
    if len(pair.times[0]) > measure.warmup:  # timed (not --benchmark-disable)
        benchmark.extra_info["paired_ratio"] = pair.ratio(measure.warmup)
        for arm, t in zip((first, second), pair.times):
            benchmark.extra_info[f"{arm}_median_ms"] = statistics.median(
                t[measure.warmup:]) * 1e3


@pytest.mark.parametrize("phase", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("model", PAIRED_MODELS)
@pytest.mark.benchmark(group="layer default / reference, paired", timer=CLOCK)
def test_layer_default_against_reference(measure, benchmark, model, phase):
    """The default config and ``MOE_FN_ARMS["moe_fn-reference"]`` alternated round by
    round; ``paired_ratio`` is the median over rounds of default time / reference time
    (below 1: the default faster)."""
    _paired(measure, benchmark, model, phase, "moe_fn", "moe_fn-reference")


@pytest.mark.parametrize("phase", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("model", PAIRED_MODELS)
@pytest.mark.benchmark(group="layer fp8 / default, paired", timer=CLOCK)
def test_layer_fp8_against_default(measure, benchmark, model, phase):
    """``expert_precision="fp8_rowwise"`` and the default alternated round by round;
    ``paired_ratio``: FP8 time / default time (below 1: FP8 faster)."""
    _paired(measure, benchmark, model, phase, "moe_fn-fp8", "moe_fn")
