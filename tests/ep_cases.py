"""Expert-parallel cases shared by the gloo tests of the exchanges: each rank's layer against
the dense float64 reference over every rank's tokens."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_fn import MoEConfig, MoELayer
from moe_fn.testing import (
    MoEParams,
    assert_jointly_close_to_ref,
    layer_params,
    max_error,
    reference_moe,
)


def small_config(**kw):
    base = dict(hidden_size=8, intermediate_size=6, num_experts=4, top_k=2)
    base.update(kw)
    return MoEConfig(**base)


def randomize(layer):
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)
        layer.experts.gate_up_proj.normal_(0, 0.5)
        layer.experts.down_proj.normal_(0, 0.5)
        for p in (layer.router.bias, layer.experts.gate_up_proj_bias,
                  layer.experts.down_proj_bias):
            if p is not None:
                p.normal_(0, 0.5)


def load_rank_slice(layer, full, rank):
    """Copy into ``layer`` (rank ``rank``'s expert-parallel layer) the replicated parameters
    of ``full`` (one layer holding every expert) and its own experts' slice, which it
    returns (the expert dimension's slice of ``full``'s tensors)."""
    e_local = layer.config.num_local_experts
    sl = slice(rank * e_local, (rank + 1) * e_local)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            src = full.get_parameter(name)
            p.copy_(src[sl] if name.startswith("experts.") else src)
        for name, b in layer.named_buffers():
            b.copy_(full.get_buffer(name))
    return sl


# Float64 results in another summation order than the oracle's: within this many float64
# rounding steps at the largest magnitude among them (one float32 step is 2**29 of them).
FLOAT64_STEPS = 64
NAMES = {"router_weight": "router.weight", "router_bias": "router.bias",
         "gate_up_proj": "experts.gate_up_proj", "down_proj": "experts.down_proj",
         "gate_up_proj_bias": "experts.gate_up_proj_bias",
         "down_proj_bias": "experts.down_proj_bias"}


def reference_run(x, params, cfg, g, dtype, **kw):
    """``reference_moe`` in ``dtype`` on ``x`` and ``params`` (float64), the loss
    ``sum(out * g)``: ``{"out", "x", parameter name: gradient}`` and the route taken."""
    leaves = {n: None if t is None else t.detach().to(dtype).requires_grad_(n in NAMES)
              for n, t in params._asdict().items()}
    xl = x.detach().to(dtype).requires_grad_()
    ref = reference_moe(xl, MoEParams(**leaves), cfg, **kw)
    (ref.out * g.to(dtype)).sum().backward()
    got = {"out": ref.out.detach(), "x": xl.grad}
    got.update((NAMES[n], t.grad) for n, t in leaves.items() if n in NAMES and t is not None)
    return got, ref.route


def gathered_params(layer) -> MoEParams:
    """An expert-parallel layer's parameters with every rank's experts (all-gathered: a
    collective), detached."""
    world = layer.exchange.ep_size

    def gather(t):
        if t is None:
            return None
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.detach().contiguous(), group=layer.exchange.group)
        return torch.cat(parts)
    p = layer_params(layer)
    return p._replace(router_weight=p.router_weight.detach(),
                      router_bias=None if p.router_bias is None else p.router_bias.detach(),
                      score_correction_bias=None if p.score_correction_bias is None
                      else p.score_correction_bias.detach(),
                      gate_up_proj=gather(p.gate_up_proj), down_proj=gather(p.down_proj),
                      gate_up_proj_bias=gather(p.gate_up_proj_bias),
                      down_proj_bias=gather(p.down_proj_bias))


def rank_results(results, rows, experts):
    """``reference_run``'s results as rank's layer holds them: its tokens ``rows``, its
    experts ``experts`` (slices), the router's whole."""
    return {n: t[rows] if n in ("out", "x") else t[experts] if n.startswith("experts.")
            else t for n, t in results.items()}


def assert_float64_close(got, want, names, scale):
    """Float64 results ``got[i]`` each within ``FLOAT64_STEPS`` float64 rounding steps of
    ``want[i]`` at magnitude ``scale``, the largest of the whole computation's results (an
    analytically zero gradient is rounding noise of terms of that size; a rank may hold no
    tokens): a float32 rounding anywhere on the way shows."""
    bound = FLOAT64_STEPS * torch.finfo(torch.float64).eps * scale
    for g, w, name in zip(got, want, names):
        assert g.dtype == w.dtype == torch.float64, (name, g.dtype, w.dtype)
        err = max_error(g, w)
        assert err <= bound, (f"{name}: error {err:.3g} > {FLOAT64_STEPS} float64 steps at "
                              f"the results' magnitude {scale:.3g}: {bound:.3g}")


def ep_case(rank, world, kw, tokens_per_rank, seed, exchange_kw=None, dtype=torch.float64,
            before_ep=None):
    """Rank ``rank``'s part of an expert-parallel layer in ``dtype`` against the float64
    reference MoE (``moe_fn.testing.reference_moe``) holding every expert and every rank's
    tokens. Float64: within a few float64 rounding steps (DeepEP's stand-in: of the
    reference with the routing weights, and their gradient, rounded to float32 as DeepEP
    carries them); float32: by the tolerance rule, with the reference in float32 on the
    same inputs (and route) as plain. ``ref``, a float64 layer, only holds the full
    parameter set (and, after the backward, the reference's gradients). ``before_ep`` runs
    just before the expert-parallel layer's first call."""
    torch.manual_seed(seed)
    cfg_full = small_config(**kw)
    ref = MoELayer(cfg_full, dtype=torch.float64)
    randomize(ref)
    with torch.no_grad():
        if cfg_full.score_correction_bias:
            # Steer every token away from the last rank's experts and from expert 0.
            bias = torch.zeros(cfg_full.num_experts, dtype=torch.float32)
            e_local = cfg_full.num_experts // world
            bias[-e_local:] = -100.0
            bias[0] = -100.0
            ref.router.e_score_correction_bias.copy_(bias)
    xs = [torch.randn(n, cfg_full.hidden_size, dtype=torch.float64) for n in tokens_per_rank]
    gs = [torch.randn_like(x) for x in xs]
    x_all = torch.cat(xs).requires_grad_()
    out_all = reference_moe(x_all, layer_params(ref), cfg_full).out
    (out_all * torch.cat(gs)).sum().backward()

    cfg = small_config(**{**kw, "comm_backend": "all_to_all", "ep_size": world,
                          **(exchange_kw or {})})
    layer = MoELayer(cfg, dtype=dtype)
    sl = load_rank_slice(layer, ref, rank)
    start = sum(tokens_per_rank[:rank])
    rows = slice(start, start + tokens_per_rank[rank])
    plain = {}
    params = MoEParams(*(None if t is None else t.detach() for t in layer_params(ref)))
    if dtype != torch.float64:
        # Plain: the reference in dtype on the same inputs, with the float64 route; the
        # expert-parallel layer's error against float64 may be at most twice its, output and
        # gradients taken as one (some are small: a bias, an 8-expert router).
        route64 = reference_moe(x_all.detach(), params, cfg_full).route
        plain, _ = reference_run(x_all, params, cfg_full, torch.cat(gs), dtype,
                                 topk_idx=route64.topk_idx)
        plain["out"], plain["x"] = plain["out"][rows], plain["x"][rows]
    rounded = {}
    if dtype == torch.float64 and cfg.comm_backend == "deepep":
        # DeepEP's API carries routing weights (and their gradients) as float32: the
        # oracle rounds them there too, and only there.
        rounded, _ = reference_run(x_all, params, cfg_full, torch.cat(gs), dtype,
                                   weights_dtype=torch.float32)
        rounded["out"], rounded["x"] = rounded["out"][rows], rounded["x"][rows]

    if before_ep is not None:
        before_ep()
    x = xs[rank].to(dtype).requires_grad_()
    out = layer(x)
    (out * gs[rank].to(dtype)).sum().backward()

    # The layer's results checked as one: (got, plain, ref, name) in float32, (got, ref,
    # name) in float64.
    joint = ([], [], [], []) if plain else ([], [], [])

    def assert_close(got, want, name):
        if plain:
            row = (got, plain[name], want.to(torch.float64), name)
        else:
            row = (got, rounded[name] if rounded else want, name)
        for part, v in zip(joint, row):
            part.append(v)
    assert_close(out, out_all[rows].detach(), "out")
    assert_close(x.grad, x_all.grad[rows], "x")
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    assert_close(router_grad, ref.router.weight.grad, "router.weight")
    if cfg.router_bias:
        bias_grad = layer.router.bias.grad.clone()
        dist.all_reduce(bias_grad)
        assert_close(bias_grad, ref.router.bias.grad, "router.bias")
    experts = ["gate_up_proj", "down_proj"]
    if cfg.expert_bias:
        experts += ["gate_up_proj_bias", "down_proj_bias"]
    for table in (plain, rounded):
        for name in experts:
            if table:
                table["experts." + name] = table["experts." + name][sl]
    for name in experts:
        assert_close(getattr(layer.experts, name).grad, getattr(ref.experts, name).grad[sl],
                     "experts." + name)
    if plain:
        assert_jointly_close_to_ref(*joint)
    else:
        full = [out_all, x_all.grad, *(p.grad for p in ref.parameters())]
        assert_float64_close(*joint, max(t.abs().max().item() for t in full))
    c = layer.exchange.counters
    assert (c["layout"], c["dispatch"], c["combine"]) == (1, 1, 1)
    if cfg.score_correction_bias:
        # The bias steers every token off expert 0 and off the last rank: they see no rows.
        assert float(ref.experts.down_proj.grad[0].abs().sum()) == 0.0
        if rank == world - 1:
            assert float(layer.experts.down_proj.grad.abs().sum()) == 0.0
    # Without grad mode (a reentrant checkpoint's first forward) the combine keeps nothing
    # and may read rows where they are: the same sums in the same order, the same output.
    with torch.no_grad():
        torch.testing.assert_close(layer(x), out.detach(), rtol=0, atol=0)


EP_CASES = [
    dict(num_experts=8, top_k=2),
    dict(num_experts=8, top_k=3),
    dict(num_experts=8, top_k=1, score_apply="pre", gate_up_impl="separate"),
    dict(num_experts=8, top_k="E/ep", score_apply="activation", activation="swiglu_oai"),
    # Steered routing: expert 0 and the whole last rank receive no rows.
    dict(num_experts=8, top_k=2, score_correction_bias=True, score_func="sigmoid"),
    dict(num_experts=8, top_k=2, router_bias=True, expert_bias=True, score_func="softmax_topk",
         norm_topk_prob=False, activation="swiglu_oai", gate_up_layout="interleaved"),
]
