"""The MoE layer, forward and forward + backward, on one GPU (the local exchange).

Arms, all holding the same weights: moe_fn's ``MoELayer`` with the default config and with
the reference path (``impl="reference"``, ``shapes.MOE_FN_ARMS``), transformers'
``Qwen3MoeSparseMoeBlock`` with ``grouped_mm`` experts (where its softmax routing is the
model's), and a plain PyTorch layer (``plain.PlainLayer``). The forward runs with autograd
on, as in training, from an idle GPU (its host time before the first GEMM included);
forward + backward resets the gradients to None first. FLOPs: 2 T k H 3I forward, three
times that forward + backward. ``max_rel_diff_vs_torch``: the output against the plain
layer's, relative to its largest entry.
"""

from __future__ import annotations

import copy
import statistics
import time

import pytest
import torch

from bench import harness, plain, shapes
from bench.checks import check, f64, stable_tokens
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
    fns, params = {}, {}
    for arm, options in MOE_FN_ARMS.items():
        layer = MoELayer(model.config(**options), device=dev, dtype=dt)
        with torch.no_grad():
            layer.router.weight.copy_(router)
            layer.experts.gate_up_proj.copy_(gate_up)
            layer.experts.down_proj.copy_(down)
        fns[arm], params[arm] = layer, list(layer.parameters())
    if plain.hf_applies(model):
        fns["transformers"] = plain.hf_block(model, router, gate_up, down)
        params["transformers"] = list(fns["transformers"].module.parameters())
    bias = (torch.zeros(e, device=dev) if model.routing.get("score_correction_bias")
            else None)
    fns["torch"] = plain.PlainLayer(model, router, gate_up, down, bias)
    params["torch"] = list(fns["torch"].parameters())
    return dict(fns=fns, params=params)


def inputs(model, d):
    """An input, its output gradient, the plain layer's output and its float64 twin's on the
    same input, and the tokens whose route is the same at any precision."""
    x = harness.randn(model.tokens, model.hidden, seed=4).requires_grad_()
    layer = d["fns"]["torch"]
    layer64 = copy.deepcopy(layer).double()
    x64 = f64(x).detach()
    layer_fp8 = copy.deepcopy(layer)
    layer_fp8.fp8 = True
    with torch.no_grad():
        out = layer(x)
        out_fp8 = layer_fp8(x)
        ref64 = layer64(x64)
        stable = stable_tokens(torch.nn.functional.linear(x64, layer64.router), model,
                               x.dtype)
    assert stable.float().mean() > 0.25, "too few well-routed tokens to check the layer"
    return dict(x=x, dy=harness.randn(model.tokens, model.hidden, seed=5), ref=out.float(),
                plain_out=out, plain_fp8_out=out_fp8, ref64=ref64, stable=stable)


def check_layer(d, arm, out) -> None:
    """The arm's output by the tolerance rule against the plain layer's on the tokens whose
    route rounding cannot change (the FP8 arm: against the FP8 rule's plain layer)."""
    s = d["stable"]
    want = d["plain_fp8_out" if arm.endswith("fp8") else "plain_out"]
    check(out[s], want[s], d["ref64"][s], arm)


def rel_diff(out, ref) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("phase", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("model,arm", CASES, ids=[f"{m}-{a}" for m, a in CASES])
@pytest.mark.benchmark(group="layer", timer=CLOCK)
def test_layer(measure, model, arm, phase):
    model = shapes.get(model)
    d = _layers.get(model.weights_key, lambda: build_weights(model))
    d = _inputs.get(model.name, lambda: dict(d, **inputs(model, d)))
    fn, x, dy, leaves = d["fns"][arm], d["x"], d["dy"], d["params"][arm]
    with torch.no_grad():
        got = fn(x)
        check_layer(d, arm, got)
        diff = rel_diff(got, d["ref"])

    def step():
        for p in leaves:
            p.grad = None
        x.grad = None
        fn(x).backward(dy)

    backward = phase == "fwd+bwd"
    flops = layer_flops(model)
    measure(step if backward else (lambda: fn(x)), shape=f"{model.name} {phase}",
            flops=3 * flops if backward else flops,
            info={"tokens": model.tokens, "max_rel_diff_vs_torch": diff,
                  "options": MOE_FN_ARMS.get(arm)})


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
    with torch.no_grad():
        check_layer(d, arm, fn(x))

    def forwards():
        for _ in range(PIPELINE):
            fn(x)
    measure(forwards, shape=f"{model.name} fwd x{PIPELINE}",
            flops=PIPELINE * layer_flops(model), info={"tokens": model.tokens})
    if benchmark.stats is not None and benchmark.stats.stats.data:
        benchmark.extra_info["per_forward_ms"] = benchmark.stats.stats.median / PIPELINE * 1e3


class _Paired:
    """Times two calls in each round, each from an idle device, in alternating order, so
    that the ratio of their times is paired round by round (drift of a shared machine
    cancels); the benchmark's own time is the pair's."""

    def __init__(self, first, second):
        self.fns, self.times, self.calls = (first, second), ([], []), 0

    @staticmethod
    def _time(fn) -> float:
        if not harness.HAS_CUDA:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def __call__(self):
        order = (0, 1) if self.calls % 2 == 0 else (1, 0)
        self.calls += 1
        for i in order:
            self.times[i].append(self._time(self.fns[i]))

    def ratio(self, skip: int) -> float:
        """Median over the rounds after the first ``skip`` of first time / second time."""
        return statistics.median(a / b for a, b in zip(*(t[skip:] for t in self.times)))


def _paired(measure, benchmark, model, phase, first, second):
    model = shapes.get(model)
    d = _layers.get(model.weights_key, lambda: build_weights(model))
    d = _inputs.get(model.name, lambda: dict(d, **inputs(model, d)))
    x, dy = d["x"], d["dy"]
    with torch.no_grad():
        for arm in (first, second):
            check_layer(d, arm, d["fns"][arm](x))

    def call(arm):
        fn, leaves = d["fns"][arm], d["params"][arm]
        if phase == "fwd":
            return lambda: fn(x)

        def step():
            for p in leaves:
                p.grad = None
            x.grad = None
            fn(x).backward(dy)
        return step

    pair = _Paired(call(first), call(second))
    flops = layer_flops(model) * (3 if phase == "fwd+bwd" else 1)
    measure(pair, shape=f"{model.name} {phase}", flops=2 * flops,
            info={"tokens": model.tokens, "pair": [first, second]})
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
