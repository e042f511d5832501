"""expert_precision='fp8_rowwise' on the CPU: the layer and moe_fn.functional.experts against
the unquantised float64 oracle, by the tolerance rule with a plain FP8 computation written
from the recipe (moe_fn.testing.fp8) as plain; the quantised-weight cache; the refusals; and
expert parallelism over gloo against the one-process FP8 layer."""

from __future__ import annotations

import copy
import pickle

import attrs
import pytest
import torch
import torch.distributed as dist

import moe_fn
from moe_fn import MoEConfig, MoELayer, functional
from moe_fn.autograd.fp8_cache import Fp8WeightCache
from moe_fn.testing import (
    assert_jointly_close_to_ref,
    layer_params,
    reference_activation,
    reference_moe,
    split_gate_up,
)
from moe_fn.testing.fp8 import fp8_linear
from tests import fake_deep_ep
from tests.dist_utils import run_distributed
from tests.ep_cases import load_rank_slice

DTYPES = (torch.float32, torch.bfloat16)


def _config(**kw):
    base = dict(hidden_size=32, intermediate_size=16, num_experts=4, top_k=2,
                expert_precision="fp8_rowwise")
    base.update(kw)
    return MoEConfig(**base)


def _layer(cfg, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    layer = MoELayer(cfg, dtype=dtype)
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)
        layer.experts.gate_up_proj.normal_(0, 0.3)
        layer.experts.down_proj.normal_(0, 0.3)
        for p in (layer.router.bias, layer.experts.gate_up_proj_bias,
                  layer.experts.down_proj_bias):
            if p is not None:
                p.normal_(0, 0.3)
    return layer


def _run(layer, x, g):
    x = x.detach().clone().requires_grad_()
    out, logits = layer(x, return_router_logits=True)
    (out.float() * g.float()).sum().backward()
    grads = [x.grad] + [p.grad for _, p in sorted(layer.named_parameters())]
    return [out.detach(), logits.detach(), *grads]


def _reference(params, cfg, x, g, *, fp8):
    x = x.detach().clone().requires_grad_()
    leaves = params._replace(**{k: v.detach().clone().requires_grad_()
                                for k, v in params._asdict().items()
                                if isinstance(v, torch.Tensor) and v.is_floating_point()
                                and k != "score_correction_bias"})
    res = reference_moe(x, leaves, cfg, fp8=fp8)
    (res.out.float() * g.float()).sum().backward()
    names = {"router_weight": "router.weight", "router_bias": "router.bias",
             "gate_up_proj": "experts.gate_up_proj", "down_proj": "experts.down_proj",
             "gate_up_proj_bias": "experts.gate_up_proj_bias",
             "down_proj_bias": "experts.down_proj_bias"}
    by_name = {names[k]: getattr(leaves, k).grad for k in names
               if getattr(leaves, k) is not None}
    return [res.out.detach(), res.logits.detach(), x.grad] + [by_name[n]
                                                              for n in sorted(by_name)]


CASES = {
    "softmax-post": dict(),
    "sigmoid-activation": dict(score_func="sigmoid", score_apply="activation", top_k=3),
    # A clamp limit these inputs never reach: near the limit FP8's rounding decides which
    # side of the clamp's kink an element falls, so plain FP8 and the unquantised oracle
    # disagree on whole gradient entries and the rule cannot fail (the clamp is checked at
    # native precision against HF's GPT-OSS).
    "gpt-oss": dict(activation="swiglu_oai", gate_up_layout="interleaved", expert_bias=True,
                    router_bias=True, activation_limit=1000.0),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matches_the_float64_oracle_by_the_plain_fp8_rule(case, dtype):
    cfg = _config(**CASES[case])
    ref_layer = _layer(cfg, seed=3)
    params = layer_params(ref_layer)
    torch.manual_seed(5)
    # Rows of magnitudes 2**-3 .. 2**3: their scales differ.
    x = torch.randn(2, 9, cfg.hidden_size, dtype=torch.float64) * torch.exp2(
        torch.randint(-3, 4, (2, 9, 1))).double()
    g = torch.randn_like(x)
    # Oracle: unquantised, float64; plain: the FP8 recipe in naive PyTorch, in dtype.
    ref64 = _reference(params, cfg, x, g, fp8=False)
    plain = _reference(params._replace(**{k: v.to(dtype) for k, v in params._asdict().items()
                                          if isinstance(v, torch.Tensor)
                                          and k != "score_correction_bias"}),
                       cfg, x.to(dtype), g.to(dtype), fp8=True)
    layer = _layer(cfg, dtype=dtype)
    layer.load_state_dict(ref_layer.state_dict())
    got = _run(layer, x.to(dtype), g.to(dtype))
    names = ["out", "logits", "x", *sorted(n for n, _ in layer.named_parameters())]
    assert len(got) == len(plain) == len(ref64) == len(names)
    assert_jointly_close_to_ref(got, plain, ref64, names)
    assert layer.fp8_weights.quantizations == 1


def test_quantisation_is_what_the_error_comes_from():
    # The FP8 layer is further from float64 than the native one: it does quantise.
    cfg = _config()
    native = _layer(attrs.evolve(cfg, expert_precision="native"),
                    dtype=torch.float32)
    fp8 = _layer(cfg, dtype=torch.float32)
    fp8.load_state_dict(native.state_dict())
    x = torch.randn(16, cfg.hidden_size)
    ref = _layer(attrs.evolve(cfg, expert_precision="native"))
    ref.load_state_dict(native.state_dict())
    y64 = ref(x.double())
    e_native = (native(x).double() - y64).abs().max()
    e_fp8 = (fp8(x).double() - y64).abs().max()
    assert e_fp8 > 100 * e_native


def test_checkpoint_replays_and_reuses_the_quantised_weights():
    cfg = _config()
    layer = _layer(cfg, dtype=torch.float32)
    plain = _layer(cfg, dtype=torch.float32)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(12, cfg.hidden_size)
    g = torch.randn_like(x)
    want = _run(plain, x, g)
    xc = x.clone().requires_grad_()
    out = moe_fn.checkpoint(layer, xc)
    (out * g).sum().backward()
    assert torch.equal(out.detach(), want[0])
    assert torch.equal(xc.grad, want[2])
    for (n, p), (_, q) in zip(sorted(layer.named_parameters()), sorted(plain.named_parameters())):
        assert torch.equal(p.grad, q.grad), n
    # Forward, recompute and backward read one quantisation of the weights.
    assert layer.fp8_weights.quantizations == 1


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.05),
    # Fused AdamW writes the weights without moving their version counters.
    lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
], ids=["sgd", "adamw-fused", "adamw-foreach"])
def test_a_changed_weight_is_quantised_again(make_opt):
    cfg = _config()
    layer = _layer(cfg, dtype=torch.float32)
    opt = make_opt(layer.parameters())
    x = torch.randn(10, cfg.hidden_size)
    for step in range(3):
        opt.zero_grad()
        layer(x).square().mean().backward()
        opt.step()
        fresh = _layer(cfg, dtype=torch.float32)
        fresh.load_state_dict(layer.state_dict())
        with torch.no_grad():
            y = layer(x)
            assert bool(y.isfinite().all()) and torch.equal(y, fresh(x)), step
    assert layer.fp8_weights.quantizations == 4  # three steps' forwards and the last check
    # .data replaced (no version change) and an explicit invalidation.
    before = layer.fp8_weights.quantizations
    layer.experts.down_proj.data = layer.experts.down_proj.data * 2
    with torch.no_grad():
        fresh = _layer(cfg, dtype=torch.float32)
        fresh.load_state_dict(layer.state_dict())
        assert torch.equal(layer(x), fresh(x))
        assert layer.fp8_weights.quantizations == before + 1
        layer.fp8_weights.invalidate()
        layer(x)
    assert layer.fp8_weights.quantizations == before + 2


def test_the_cache_does_not_travel_with_a_copy():
    cfg = _config()
    layer = _layer(cfg, dtype=torch.float32)
    x = torch.randn(6, cfg.hidden_size)
    with torch.no_grad():
        y = layer(x)
        for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert other.fp8_weights.quantizations == 0
            assert torch.equal(other(x), y)
            assert other.fp8_weights._value.gate_up.q.data_ptr() != \
                layer.fp8_weights._value.gate_up.q.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_functional_experts_match_the_oracle_with_empty_experts(dtype):
    torch.manual_seed(2)
    counts = [4, 0, 7, 2]
    e, h, i = len(counts), 32, 16
    x = torch.randn(sum(counts), h, dtype=torch.float64) * torch.exp2(
        torch.randint(-3, 4, (sum(counts), 1))).double()
    gu = torch.randn(e, 2 * i, h, dtype=torch.float64) * 0.3
    dn = torch.randn(e, h, i, dtype=torch.float64) * 0.3
    w = torch.rand(sum(counts), dtype=torch.float64)
    dy = torch.randn(sum(counts), h, dtype=torch.float64)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)

    def naive(x, gu, dn, w, fp8):
        lin = fp8_linear if fp8 else (lambda a, b: a @ b.t())
        outs, start = [], 0
        for ex, c in enumerate(counts):
            r = slice(start, start + c)
            hh = reference_activation(*split_gate_up(lin(x[r], gu[ex]), "halves"), "swiglu")
            outs.append(lin(hh * w[r, None], dn[ex]))
            start += c
        return torch.cat(outs)

    def results(f, dt):
        leaves = [t.detach().to(dt).requires_grad_() for t in (x, gu, dn, w)]
        y = f(*leaves)
        (y.float() * dy.to(dt).float()).sum().backward()
        return [y.detach()] + [t.grad for t in leaves]

    ref64 = results(lambda *a: naive(*a, fp8=False), torch.float64)
    plain = results(lambda *a: naive(*a, fp8=True), dtype)
    cache = Fp8WeightCache()
    got = results(lambda x, gu, dn, w: functional.experts(
        x, gu, dn, offs, weights=w, precision="fp8_rowwise", fp8_weights=cache), dtype)
    assert_jointly_close_to_ref(got, plain, ref64, ["y", "x", "gate_up", "down", "weights"])
    assert float(got[2][1].abs().sum()) == 0.0 and float(got[3][1].abs().sum()) == 0.0


@pytest.mark.parametrize("kw, match", [
    (dict(gate_up_impl="separate"), "gate_up_impl='fused'"),
    (dict(score_apply="pre"), "score_apply 'post' or 'activation'"),
    (dict(hidden_size=24), "hidden_size to be a multiple of 16"),
    (dict(intermediate_size=20), "intermediate_size to be a multiple of 16"),
    (dict(expert_precision="fp8"), "expert_precision must be one of"),
])
def test_unsupported_combinations_fail_at_configuration(kw, match):
    with pytest.raises(ValueError, match=match):
        _config(**kw)


def test_a_torch_without_the_grouped_fp8_gemm_is_refused(monkeypatch):
    monkeypatch.delattr(torch, "_scaled_grouped_mm")
    with pytest.raises(ValueError, match="needs torch._scaled_grouped_mm"):
        _config()


def test_dtypes_it_cannot_take_fail_at_the_call():
    layer = _layer(_config(), dtype=torch.float64)
    with pytest.raises(TypeError, match="bfloat16 \\(or float32 on the CPU"):
        layer(torch.randn(3, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="precision must be one of"):
        functional.experts(torch.randn(2, 32), torch.randn(1, 32, 32), torch.randn(1, 32, 16),
                           torch.tensor([2], dtype=torch.int32), precision="fp8_e5m2")
    with pytest.raises(ValueError, match="gate_up_impl='fused'"):
        functional.experts(torch.randn(2, 32), torch.randn(1, 32, 32), torch.randn(1, 32, 16),
                           torch.tensor([2], dtype=torch.int32), precision="fp8_rowwise",
                           gate_up_impl="separate")
    with pytest.raises(ValueError, match="fp8_weights holds quantised weights"):
        functional.experts(torch.randn(2, 32), torch.randn(1, 32, 32), torch.randn(1, 32, 16),
                           torch.tensor([2], dtype=torch.int32), fp8_weights=Fp8WeightCache())


def test_an_overflow_is_named_under_debug_checks():
    layer = _layer(_config(), dtype=torch.float32)
    x = torch.randn(5, 32)
    with torch.no_grad():
        layer.experts.gate_up_proj[:, 0, 0] = float("inf")
    moe_fn.set_debug_checks(True)
    try:
        with pytest.raises(FloatingPointError, match="the activation's output has non-finite"):
            layer(x)
    finally:
        moe_fn.set_debug_checks(False)


# ---- expert parallelism over gloo --------------------------------------------------------


def _ep_body(rank, world, backends, tokens):
    fake_deep_ep.install()  # comm_backend="deepep": DeepEP's Buffer over gloo
    for backend in backends:
        _ep_case(rank, world, backend, tokens)


def _ep_case(rank, world, backend, tokens):
    cfg_full = _config(num_experts=8)
    full = _layer(cfg_full, seed=7, dtype=torch.float32)
    torch.manual_seed(11)
    xs = [torch.randn(n, cfg_full.hidden_size) for n in tokens]
    gs = [torch.randn_like(x) for x in xs]
    want = _run(full, torch.cat(xs), torch.cat(gs))
    cfg = _config(num_experts=8, comm_backend=backend, ep_size=world)
    layer = MoELayer(cfg, dtype=torch.float32)
    sl = load_rank_slice(layer, full, rank)
    start = sum(tokens[:rank])
    rows = slice(start, start + tokens[rank])
    got = _run(layer, xs[rank], gs[rank])
    # Each token is quantised as at home and each expert row's GEMM is exact then rounded:
    # the rows and their sums are those of one process, bit for bit.
    assert torch.equal(got[0], want[0][rows])
    assert torch.equal(got[2], want[2][rows])
    params = dict(zip(sorted(n for n, _ in layer.named_parameters()), got[3:]))
    full_grads = dict(zip(sorted(n for n, _ in full.named_parameters()), want[3:]))
    # Weight gradients sum rows from every rank: another order of float32 sums, bounded by
    # n eps sum|terms| (the row gradients and inputs are the single process's).
    router = params["router.weight"].clone()
    dist.all_reduce(router)
    for name, got_g, want_g in (("router.weight", router, full_grads["router.weight"]),
                                *((n, params[n], full_grads[n][sl])
                                  for n in ("experts.gate_up_proj", "experts.down_proj"))):
        n_terms = sum(tokens) * cfg.top_k
        bound = 2 * n_terms * torch.finfo(torch.float32).eps * want_g.abs().max()
        assert (got_g - want_g).abs().max() <= bound, (backend, name)


@pytest.mark.multiproc
@pytest.mark.parametrize("world, backends", [(2, ("all_to_all", "symm_mem", "deepep")),
                                             (4, ("all_to_all",))])
def test_expert_parallel_fp8_matches_one_process(world, backends):
    # all_to_all carries the quantised rows; symm_mem and DeepEP deliver rows in the
    # layer's dtype, which the experts quantise.
    tokens = [7, 0, 5, 9][:world]
    run_distributed(_ep_body, world, backends, tokens)
