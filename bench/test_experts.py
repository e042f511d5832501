"""Grouped linear and the expert MLP on one rank's rows, grouped by expert.

Grouped linear (the gate+up projection, H -> 2I): ``functional.grouped_linear`` (one
``torch._grouped_mm``) against a Python loop of one matmul per expert. Expert MLP
(gate+up, activation, down): ``functional.experts`` with the fused gate+up (one GEMM over
the packed weight, the packed activation) and the separate one, against plain PyTorch (three
``torch._grouped_mm`` and an eager ``silu(g) * u``) and transformers' ``grouped_mm`` experts
(``Qwen3MoeExperts``); the FP8 arms: ``functional.experts(precision="fp8_rowwise")`` with its
weights quantised once (as a layer's cache keeps them between optimizer steps) and
torchao's FP8 rowwise MoE training GEMMs (``plain.torchao_fp8_experts``; CUDA with
torchao, uniform counts). Counts: uniform; for the first shape also skewed (expert 0 empty,
the others rising linearly). Each arm's output, and in the forward + backward benchmarks one
timed round's gradients too, are checked against plain PyTorch's and its float64 twin's by
the tolerance rule (``bench.checks``). FLOPs: 2 N H 2I (grouped linear), 2 N H 3I (expert MLP)
forward, three times that forward + backward.
"""

from __future__ import annotations

import pytest
import torch

from bench import checks, harness, plain, shapes
from bench.checks import check, f64
from bench.harness import CLOCK
from bench.shapes import EXPERT_MODELS, KERNEL_MODELS, names
from moe_fn import functional
from moe_fn.autograd.fp8_cache import Fp8WeightCache

LINEAR_ARMS = ("moe_fn", "torch")
MLP_ARMS = ("moe_fn", "moe_fn-separate", "moe_fn-fp8", "torch", "transformers", "torchao-fp8")
CASES = [(m, "uniform") for m in names(EXPERT_MODELS)] + [(KERNEL_MODELS[0].name, "skewed")]
_inputs = harness.Latest()


def counts_for(kind: str, rows: int, experts: int) -> list[int]:
    if kind == "uniform":
        return [rows // experts] * experts
    raw = list(range(experts))  # expert 0 gets none
    c = [r * rows // sum(raw) // 8 * 8 for r in raw]
    c[-1] += rows - sum(c)
    return c


def _make(model, kind):
    n, h, i, e = model.expert_rows, model.hidden, model.inter, model.local_experts
    counts = counts_for(kind, n, e)
    dev = harness.device()
    gate_up = torch.nn.Parameter(harness.randn(e, 2 * i, h, scale=0.02, seed=1))
    down = torch.nn.Parameter(harness.randn(e, h, i, scale=0.02, seed=2))
    w_gate = torch.nn.Parameter(gate_up.detach()[:, :i].contiguous())
    w_up = torch.nn.Parameter(gate_up.detach()[:, i:].contiguous())
    w_down = torch.nn.Parameter(down.detach().clone())
    x = harness.randn(n, h, seed=3).requires_grad_()
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    expert_of_row = torch.repeat_interleave(torch.arange(e, device=dev),
                                            torch.tensor(counts, device=dev))[:, None]
    ones = torch.ones(n, 1, device=dev, dtype=x.dtype)
    hf = plain.hf_experts(model, gate_up, down)
    return dict(fp8_weights=Fp8WeightCache(),
                counts=counts, gate_up=gate_up, down=down, w_gate=w_gate, w_up=w_up,
                w_down=w_down, x=x, offs=offs, expert_of_row=expert_of_row, ones=ones, hf=hf,
                dy=harness.randn(n, h, seed=4), dy_linear=harness.randn(n, 2 * i, seed=5))


def _step(fn, leaves, dy, backward):
    if not backward:
        return fn
    def step():
        # As optimizer.zero_grad(set_to_none=True) leaves them: no accumulation pass.
        for p in leaves:
            p.grad = None
        fn().backward(dy)
    return step


@pytest.mark.parametrize("phase", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("arm", LINEAR_ARMS)
@pytest.mark.parametrize("model", names(KERNEL_MODELS))
@pytest.mark.benchmark(group="grouped linear", timer=CLOCK)
def test_grouped_linear(measure, model, arm, phase):
    model = shapes.get(model)
    d = _inputs.get((model.name, "uniform"), lambda: _make(model, "uniform"))
    x, w, offs, counts = d["x"], d["gate_up"], d["offs"], d["counts"]
    if arm == "moe_fn":
        def fn():
            return functional.grouped_linear(x, w, offs)
    else:
        def fn():
            return plain.grouped_linear_loop(x, w, counts)
    with torch.no_grad():
        check(fn(), plain.grouped_linear_loop(x, w, counts),
              plain.grouped_linear_loop(*f64(x, w), counts), arm)
    flops = 2 * model.expert_rows * model.hidden * 2 * model.inter
    backward = phase == "fwd+bwd"
    measure(_step(fn, (x, w), d["dy_linear"], backward), shape=f"{model.name} {phase}",
            flops=3 * flops if backward else flops, flush_l2=True)
    if backward:
        def loop(a, b):
            return plain.grouped_linear_loop(a, b, counts)
        _check_grads([x.grad, w.grad], [x, w], loop, loop, d["dy_linear"],
                     ("grouped linear", model.name), ["x", "weight"])


@pytest.mark.parametrize("phase", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("arm", MLP_ARMS)
@pytest.mark.parametrize("model,counts", CASES, ids=[f"{m}-{c}" for m, c in CASES])
@pytest.mark.benchmark(group="expert MLP", timer=CLOCK)
def test_experts(measure, model, counts, arm, phase):
    model = shapes.get(model)
    d = _inputs.get((model.name, counts), lambda: _make(model, counts))
    x, offs = d["x"], d["offs"]
    if arm == "torchao-fp8" and (counts != "uniform" or not plain.torchao_fp8_available()):
        pytest.skip("torchao's FP8 grouped GEMM: CUDA with torchao installed, groups of a "
                    "multiple of 16 rows")
    fns = {
        "moe_fn": lambda: functional.experts(x, d["gate_up"], d["down"], offs),
        "moe_fn-separate": lambda: functional.experts(x, d["gate_up"], d["down"], offs,
                                                      gate_up_impl="separate"),
        "torch": lambda: plain.experts(x, d["w_gate"], d["w_up"], d["w_down"], offs),
        "transformers": lambda: d["hf"](x, d["expert_of_row"], d["ones"]),
        "moe_fn-fp8": lambda: functional.experts(x, d["gate_up"], d["down"], offs,
                                                 precision="fp8_rowwise",
                                                 fp8_weights=d["fp8_weights"]),
        "torchao-fp8": lambda: plain.torchao_fp8_experts(x, d["gate_up"], d["down"], offs),
    }
    with torch.no_grad():
        x64, gu64, dn64 = f64(x, d["gate_up"], d["down"])
        i = model.inter
        ref64 = plain.experts(x64, gu64[:, :i], gu64[:, i:], dn64, offs)
        if arm.endswith("fp8"):  # the FP8 rule: plain is fp8_linear's quantised GEMMs
            want = plain.fp8_experts(x, d["gate_up"], d["down"], offs)
        else:
            want = plain.experts(x, d["w_gate"], d["w_up"], d["w_down"], offs)
        check(fns[arm](), want, ref64, arm)
    leaves = (x, d["gate_up"], d["down"], d["w_gate"], d["w_up"], d["w_down"])
    flops = 2 * model.expert_rows * model.hidden * 3 * model.inter
    backward = phase == "fwd+bwd"
    measure(_step(fns[arm], leaves, d["dy"], backward),
            shape=f"{model.name} {counts} {phase}", flops=3 * flops if backward else flops,
            flush_l2=True)
    if backward:
        if arm == "torch":
            weight_grads = [torch.cat([d["w_gate"].grad, d["w_up"].grad], 1), d["w_down"].grad]
        else:
            weight_grads = [d["gate_up"].grad, d["down"].grad]
        i = model.inter

        def experts(a, gu, dn):
            return plain.experts(a, gu[:, :i].contiguous(), gu[:, i:].contiguous(), dn, offs)

        def fp8_experts(a, gu, dn):
            return plain.fp8_experts(a, gu, dn, offs)
        fp8 = arm.endswith("fp8")  # the FP8 rule: plain quantises, float64 does not
        _check_grads([x.grad, *weight_grads], [x, d["gate_up"], d["down"]],
                     fp8_experts if fp8 else experts, experts, d["dy"],
                     ("expert MLP", model.name, counts, fp8), ["x", "gate_up", "down"])


def _check_grads(got, inputs, plain_fn, ref_fn, dy, key, names):
    """The last timed round's gradients ``got`` (of ``sum(out * dy)`` to ``inputs``) by the
    rule, taken jointly: against autograd of ``plain_fn`` in the benchmarks' dtype and of
    ``ref_fn`` in float64, which the arms of the group ``key`` share."""
    want = checks.memo((*key, "plain"), lambda: checks.value_and_grads(
        plain_fn, inputs, dy=dy)[1:])
    ref64 = checks.memo((*key, "float64"), lambda: checks.value_and_grads(
        ref_fn, inputs, checks.F64, dy)[1:])
    checks.assert_rule(got, want, ref64, names)
