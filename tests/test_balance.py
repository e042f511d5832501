"""In-layer balancing losses against float64 autograd of naive code, in every checkpoint mode
and over expert parallelism (global counts); expert-load statistics; the aux-loss-free
bias update against a float64 reference."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from attrs import evolve

import moe_fn
import moe_fn.balance as balance
from moe_fn import MoEConfig, MoELayer
from moe_fn.testing import MoEParams, reference_moe
from tests import fake_deep_ep
from tests.dist_utils import run_distributed
from tests.ep_cases import FLOAT64_STEPS, load_rank_slice
from tests.ep_cases import randomize as _randomize
from tests.pure.test_balance import naive_sequence, naive_switch, naive_z

H, I = 8, 6
COEFS = dict(aux_loss_coef=0.3, seq_aux_loss_coef=0.2, z_loss_coef=0.05)


def _cfg(**kw):
    base = dict(hidden_size=H, intermediate_size=I, num_experts=4, top_k=2)
    return MoEConfig(**{**base, **kw})


def _params(layer):
    return (layer.router.weight, layer.experts.gate_up_proj, layer.experts.down_proj,
            layer.router.bias)


def naive_objective(x2, params, cfg, g, seq_len, *, choice_bias=None, ranks=None,
                    group_size=1, weights_dtype=None):
    """Float64 oracle: sum(out * g) plus each balancing loss times its coefficient, from
    naive per-token code. ``ranks``: the token counts of the ranks holding ``x2``'s rows
    (the sequence-level and z-losses are each rank's own; the Switch loss with
    aux_loss_scope="group" is the whole batch's, times the group's size)."""
    w, gu, dn, rb = params
    ref = reference_moe(x2, MoEParams(w, gu, dn, rb, choice_bias), cfg,
                        weights_dtype=weights_dtype)
    out, logits = ref.out, ref.logits
    total = (out * g).sum()
    probs = "sigmoid" if cfg.score_func == "sigmoid" else "softmax"
    ranks = ranks or [x2.shape[0]]
    starts = [sum(ranks[:r]) for r in range(len(ranks))]
    if cfg.aux_loss_coef:
        if cfg.aux_loss_scope == "group":
            total = total + group_size * cfg.aux_loss_coef * naive_switch(logits, cfg.top_k,
                                                                          probs)
        else:
            for s, n in zip(starts, ranks):
                total = total + cfg.aux_loss_coef * naive_switch(logits[s:s + n], cfg.top_k,
                                                                 probs)
    for s, n in zip(starts, ranks):
        part = logits[s:s + n]
        if cfg.seq_aux_loss_coef:
            total = total + cfg.seq_aux_loss_coef * naive_sequence(part, cfg.top_k, probs,
                                                                   seq_len)
        if cfg.z_loss_coef:
            total = total + cfg.z_loss_coef * naive_z(part)
    return total, out, logits


CASES = [
    dict(),
    dict(score_func="sigmoid", score_correction_bias=True),
    dict(score_func="softmax_topk", norm_topk_prob=False, router_bias=True),
    dict(score_apply="pre"),
    dict(score_apply="activation"),
    dict(impl="reference"),
]


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("shape,seq_len", [((2, 5, H), None), ((12, H), 4), ((7, H), None)])
def test_losses_train_as_the_naive_objective(kw, shape, seq_len):
    torch.manual_seed(0)
    cfg = _cfg(**COEFS, **kw)
    layer = MoELayer(cfg, dtype=torch.float64)
    _randomize(layer)
    choice_bias = None
    if cfg.score_correction_bias:
        choice_bias = torch.tensor([0.3, -0.2, 0.1, 0.0], dtype=torch.float64)
        layer.router.e_score_correction_bias.copy_(choice_bias)
    if cfg.router_bias:
        with torch.no_grad():
            layer.router.bias.normal_(0, 0.5)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    out = layer(x, seq_len=seq_len)
    g = torch.randn_like(out)
    (out * g).sum().backward()

    refs = [p.detach().clone().requires_grad_() if p is not None else None
            for p in _params(layer)]
    x2 = x.detach().reshape(-1, H).clone().requires_grad_()
    s = shape[-2] if len(shape) == 3 else (seq_len or shape[0])
    total, ref_out, logits = naive_objective(x2, refs, cfg, g.reshape(-1, H), s,
                                             choice_bias=choice_bias)
    total.backward()
    torch.testing.assert_close(out.reshape(-1, H), ref_out)
    torch.testing.assert_close(x.grad.reshape(-1, H), x2.grad)
    for p, r in zip(_params(layer), refs):
        if p is not None:
            torch.testing.assert_close(p.grad, r.grad)
    probs = "sigmoid" if cfg.score_func == "sigmoid" else "softmax"
    losses = layer.balance_losses
    torch.testing.assert_close(losses.switch, naive_switch(logits, 2, probs).detach())
    torch.testing.assert_close(losses.sequence, naive_sequence(logits, 2, probs, s).detach())
    torch.testing.assert_close(losses.z, naive_z(logits).detach())
    torch.testing.assert_close(layer.balance_loss, 0.3 * losses.switch
                               + 0.2 * losses.sequence + 0.05 * losses.z)


def test_the_balancing_gradient_moves_the_router_towards_balance():
    """Expert 0 takes most tokens; SGD on the Switch loss alone spreads them evenly (the
    loss goes to 1, its balanced value)."""
    torch.manual_seed(0)
    layer = MoELayer(_cfg(aux_loss_coef=1.0, top_k=1), dtype=torch.float64)
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)
        layer.router.weight[0, 0] = 6.0
    x = torch.randn(64, H, dtype=torch.float64)
    x[:, 0] = 1.0  # a constant feature expert 0 favours
    opt = torch.optim.SGD(layer.router.parameters(), lr=5.0)
    values = []
    for _ in range(20):
        opt.zero_grad()
        (layer(x) * 0).sum().backward()
        values.append(layer.balance_losses.switch.item())
        opt.step()
    assert values[0] > 2.5
    assert abs(values[-1] - 1.0) < 0.02, values
    load = balance.end_load_step(layer)[""]
    assert load.steps == 1 and int(load.last.sum()) == 20 * 64


def test_default_config_adds_nothing_to_the_graph():
    layer = MoELayer(_cfg(), dtype=torch.float64)
    x = torch.randn(5, H, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(fn for fn, _ in node.next_functions)
    assert not any(type(n).__name__ == "BalanceGradBackward" for n in seen)
    assert layer.balance_loss is None and layer.balance_losses is None


def test_loss_scale_scales_the_injected_gradient():
    def grads(scale):
        torch.manual_seed(0)
        layer = MoELayer(_cfg(**COEFS), dtype=torch.float64)
        _randomize(layer)
        if scale is not None:
            balance.set_loss_scale(layer, scale)
        x = torch.randn(6, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        (layer(x) * 0).sum().backward()
        return layer.router.weight.grad

    one = grads(None)
    assert one.abs().sum() > 0
    torch.testing.assert_close(grads(0.25), 0.25 * one)
    torch.testing.assert_close(grads(torch.tensor(3.0)), 3 * one)
    for bad in (float("nan"), True, torch.ones(2)):
        with pytest.raises(ValueError, match="scale must be"):
            balance.set_loss_scale(MoELayer(_cfg()), bad)


# ---- checkpoint modes -----------------------------------------------------------------------

MODES = [("none", {}), ("reentrant", {}), ("reentrant", dict(skip_recompute_combine=True)),
         ("non_reentrant", {}), ("reentrant", dict(recompute_in_checkpoint=False)),
         ("non_reentrant", dict(recompute_in_checkpoint=False))]


class Block(torch.nn.Module):
    """``h + moe(h @ A)`` on ``(B, S, H)`` activations."""

    def __init__(self, cfg, seed, balance_group=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        e = cfg.num_experts
        self.proj = torch.nn.Parameter(torch.eye(H) + 0.1 * torch.randn(H, H, generator=g))
        self.moe = MoELayer(cfg, balance_group=balance_group)
        with torch.no_grad():
            full_gu = 0.5 * torch.randn(e, 2 * I, H, generator=g)
            full_dn = 0.5 * torch.randn(e, H, I, generator=g)
            r, el = self.moe.ep_rank, cfg.num_local_experts
            self.moe.router.weight.copy_(torch.randn(e, H, generator=g))
            self.moe.experts.gate_up_proj.copy_(full_gu[r * el:(r + 1) * el])
            self.moe.experts.down_proj.copy_(full_dn[r * el:(r + 1) * el])

    def forward(self, h):
        return h + self.moe(h @ self.proj)


def _count_all_reduces():
    """A context counting torch.distributed.all_reduce calls (the layer makes no others)."""
    calls = []
    real = dist.all_reduce

    @contextlib.contextmanager
    def counting():
        def call(*a, **kw):
            calls.append(a[0].numel())
            return real(*a, **kw)
        dist.all_reduce = call
        try:
            yield calls
        finally:
            dist.all_reduce = real
    return counting()


def run_steps(cfg, mode, *, steps=3, batch=(2, 3), rank=0, group=None):
    """SGD steps of two blocks; the routers' large learning rate changes routes. Returns
    per step the output, the input's and the parameters' gradients (replicated ones summed
    over ranks), each layer's balance loss, and the all-reduces per step."""
    torch.manual_seed(0)
    model = torch.nn.ModuleList([Block(cfg, 10, group), Block(cfg, 11, group)])
    opt = torch.optim.SGD([{"params": [b.moe.router.weight for b in model], "lr": 0.5},
                           {"params": [p for b in model for n, p in b.named_parameters()
                                       if "router" not in n], "lr": 0.01}])
    g = torch.Generator().manual_seed(100 + rank)
    record = []
    for _ in range(steps):
        x = torch.randn(*batch, H, generator=g).requires_grad_()
        with _count_all_reduces() as calls:
            h = x
            for b in model:
                h = b(h) if mode == "none" else moe_fn.checkpoint(
                    b, h, use_reentrant=mode == "reentrant")
            loss = (h * torch.linspace(-1, 1, H)).sum()
            opt.zero_grad()
            loss.backward()
            reduces = len(calls)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if dist.is_initialized():
            for n in grads:
                if "router" in n or "proj" in n:
                    dist.all_reduce(grads[n])
        losses = {f"loss{i}": b.moe.balance_loss.clone() for i, b in enumerate(model)}
        record.append({"h": h.detach().clone(), "x_grad": x.grad.clone(), **grads, **losses})
        record[-1]["reduces"] = torch.tensor(reduces)
        opt.step()
    return record, model


def assert_same(got, want, what):
    """Bit for bit: a checkpoint replays the same float32 operations on the same values."""
    assert len(got) == len(want), what
    for step, (a, b) in enumerate(zip(got, want)):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (
                f"{what} step {step} {k}: max difference "
                f"{(a[k].double() - b[k].double()).abs().max().item():.3g}")


def _check_modes(world=1, rank=0, batch=(2, 3), **kw):
    ep = dict(comm_backend="all_to_all", ep_size=world) if world > 1 else {}
    if "comm_backend" in kw:
        ep["comm_backend"] = kw.pop("comm_backend")
    cfg = _cfg(**COEFS, **{**ep, **kw})
    ref, ref_model = run_steps(cfg, "none", rank=rank, batch=batch)
    for b in ref_model:  # every forward counted once: 3 steps of B*S tokens, k rows each
        assert int(b.moe.balance.pending.sum()) == 3 * batch[0] * batch[1] * cfg.top_k
    for mode, extra in MODES[1:]:
        got, model = run_steps(evolve(cfg, **extra), mode, rank=rank, batch=batch)
        assert_same(got, ref, f"{mode} {extra} {kw}")
        for b, rb in zip(model, ref_model):
            assert torch.equal(b.moe.balance.pending, rb.moe.balance.pending), (mode, extra)
            if extra.get("skip_recompute_combine"):
                assert b.moe.exchange.counters["combine_skipped"] == 3
    return ref


@pytest.mark.filterwarnings("ignore:skip_recompute_combine=True does not apply")
@pytest.mark.parametrize("kw", [dict(), dict(score_apply="pre"),
                                dict(score_apply="post", impl="reference"),
                                dict(score_func="sigmoid", score_apply="activation")])
def test_every_checkpoint_mode_trains_as_without_one(kw):
    ref = _check_modes(**kw)
    assert all(int(step["reduces"]) == 0 for step in ref)


def _ep_group_body(rank, world):
    fake_deep_ep.install()
    batches = {2: [(3, 2), (2, 2)], 4: [(2, 2), (1, 2), (0, 2), (3, 2)]}[world]
    batch = batches[rank]
    for exchange in (dict(), dict(comm_backend="symm_mem"), dict(comm_backend="deepep")):
        _ep_oracle_case(rank, world, batches, exchange)
    # Every checkpoint mode trains as the unchecked layer, with one all-reduce of E counts
    # per layer and step, never a second one in a recompute.
    for exchange in (dict(), dict(comm_backend="symm_mem"), dict(comm_backend="deepep")):
        ref = _check_modes(world, rank, batch=batch, aux_loss_scope="group", **exchange)
        assert all(int(step["reduces"]) == 2 for step in ref)


def _ep_oracle_case(rank, world, batches, exchange):
    """Each rank's gradients against one float64 oracle of the whole batch: the Switch loss
    of the group's counts (times the group's size), the sequence-level and z-losses of each
    rank's own tokens."""
    torch.manual_seed(5)
    full = _cfg(**COEFS, num_experts=8, aux_loss_scope="group")
    ref_layer = MoELayer(evolve(full, aux_loss_coef=0.0, seq_aux_loss_coef=0.0,
                                z_loss_coef=0.0, aux_loss_scope="micro_batch"),
                         dtype=torch.float64)
    _randomize(ref_layer)
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(b, s, H, dtype=torch.float64, generator=gen) for b, s in batches]
    gs = [torch.randn_like(x) for x in xs]
    refs = [p.detach().clone().requires_grad_() if p is not None else None
            for p in _params(ref_layer)]
    x_all = torch.cat([x.reshape(-1, H) for x in xs]).requires_grad_()
    ranks = [b * s for b, s in batches]
    deepep = exchange.get("comm_backend") == "deepep"
    # DeepEP carries the routing weights and their gradients as float32: so does its oracle.
    total, ref_out, _ = naive_objective(x_all, refs, full, torch.cat(
        [g.reshape(-1, H) for g in gs]), batches[0][1], ranks=ranks, group_size=world,
        weights_dtype=torch.float32 if deepep else None)
    total.backward()

    cfg = evolve(full, **{"comm_backend": "all_to_all", "ep_size": world, **exchange})
    layer = MoELayer(cfg, dtype=torch.float64)
    sl = load_rank_slice(layer, ref_layer, rank)
    x = xs[rank].clone().requires_grad_()
    out = layer(x)
    (out * gs[rank]).sum().backward()
    start = sum(ranks[:rank])
    rows = slice(start, start + ranks[rank])
    # DeepEP: a few float64 rounding steps at the results' magnitude (a float32 data path
    # is off by 2**29 of them).
    scale = max(t.abs().max().item() for t in (ref_out, x_all.grad, refs[0].grad, refs[1].grad))
    tol = dict(rtol=0, atol=FLOAT64_STEPS * torch.finfo(torch.float64).eps * scale) if deepep \
        else {}
    torch.testing.assert_close(out.reshape(-1, H), ref_out[rows].detach(), **tol)
    torch.testing.assert_close(x.grad.reshape(-1, H), x_all.grad[rows], **tol)
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    torch.testing.assert_close(router_grad, refs[0].grad, **tol)
    torch.testing.assert_close(layer.experts.gate_up_proj.grad, refs[1].grad[sl], **tol)
    # Each rank's value is its share times the group's size: their mean is the whole
    # batch's Switch loss.
    share = layer.balance_losses.switch.clone()
    dist.all_reduce(share)
    probs = naive_switch(x_all.detach() @ refs[0].detach().t(), cfg.top_k, "softmax")
    torch.testing.assert_close(share / world, probs.detach())


@pytest.mark.multiproc
@pytest.mark.filterwarnings("ignore:skip_recompute_combine=True does not apply")
@pytest.mark.parametrize("world", [2, 4])
def test_group_counts_train_as_the_whole_batch_under_expert_parallelism(world):
    run_distributed(_ep_group_body, world)


# ---- expert load and the aux-loss-free bias update ------------------------------------------


def test_expert_load_counts_training_forwards_once():
    cfg = _cfg(**COEFS)
    layer = MoELayer(cfg, dtype=torch.float64)
    x = torch.randn(2, 3, H, dtype=torch.float64)
    want = torch.bincount(layer.route(x.reshape(-1, H))[1].reshape(-1), minlength=4)
    with torch.no_grad():
        layer(x)  # evaluation: not counted
    assert balance.expert_load(layer)[""].pending.sum() == 0
    moe_fn.checkpoint(layer, x.requires_grad_(), use_reentrant=True).sum().backward()
    moe_fn.checkpoint(layer, x, use_reentrant=False).sum().backward()
    layer(x).sum().backward()
    load = balance.expert_load([layer])["0"]
    assert torch.equal(load.pending, 3 * want) and load.steps == 0
    loads = balance.end_load_step(layer)
    assert torch.equal(loads[""].last, 3 * want) and loads[""].steps == 1
    assert loads[""].pending.sum() == 0
    layer(x).sum().backward()
    loads = balance.end_load_step(layer)
    assert torch.equal(loads[""].last, want) and torch.equal(loads[""].total, 4 * want)
    mean = want.double().mean()
    torch.testing.assert_close(loads[""].max_violation.double(), want.max() / mean - 1)


def _reference_choice(x, weight, bias, cfg):
    """Each token's experts (ascending) by a float64 naive routing with the bias steering
    the choice."""
    scores = torch.sigmoid(x @ weight.t())
    idx = torch.sort(scores + bias, dim=-1, descending=True, stable=True)[1][:, :cfg.top_k]
    return idx.sort(dim=-1)[0]


def _reference_loads(x, weight, bias, cfg):
    """Rows per expert of :func:`_reference_choice`."""
    return torch.bincount(_reference_choice(x, weight, bias, cfg).reshape(-1),
                          minlength=cfg.num_experts)


def _bias_steps(rank=0, world=1):
    """Four steps of two micro-batches each; after every optimizer step the bias moves by
    the loads of the step's whole batch (every rank's). Against a float64 bias updated by
    the definition from naive routing."""
    cfg = _cfg(num_experts=8, score_func="sigmoid", score_correction_bias=True,
               norm_topk_prob=True, **({} if world == 1 else dict(comm_backend="all_to_all",
                                                                   ep_size=world)))
    torch.manual_seed(3)
    layer = MoELayer(cfg, dtype=torch.float64)
    _randomize(layer)
    full_w = layer.router.weight.detach().clone()  # one seed: the same on every rank
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)  # the bias alone moves the routes
    rate = 2.0 ** -4
    ref_bias = torch.zeros(8, dtype=torch.float64)
    gen = torch.Generator().manual_seed(11)
    # One fixed batch routed after every update: only the bias can change its routes.
    probe = torch.randn(32, H, dtype=torch.float64, generator=torch.Generator().manual_seed(12))

    def probe_routes():
        with torch.no_grad():
            got = layer.route(probe)[1].sort(dim=-1)[0]
        assert torch.equal(got, _reference_choice(probe, full_w, ref_bias, cfg))
        return got

    routes = [probe_routes()]
    for _ in range(4):
        load = torch.zeros(8, dtype=torch.int64)
        for _micro in range(2):
            xs = [torch.randn(5, H, dtype=torch.float64, generator=gen) for _ in range(world)]
            layer(xs[rank]).sum().backward()
            for x in xs:
                load += _reference_loads(x, full_w, ref_bias, cfg)
        opt.step()
        loads = balance.update_expert_bias(layer, rate)
        assert torch.equal(loads[""].last, load)
        ref_bias += rate * torch.sign(load.double().mean() - load.double())
        assert torch.equal(layer.router.e_score_correction_bias.double(), ref_bias)
        routes.append(probe_routes())
    # The bias moved routes: the same tokens go elsewhere than before the first update.
    assert not torch.equal(routes[0], routes[-1])


def test_bias_update_matches_the_reference_over_several_steps():
    _bias_steps()


def _bias_body(rank, world):
    _bias_steps(rank, world)


@pytest.mark.multiproc
def test_bias_update_matches_the_reference_under_expert_parallelism():
    run_distributed(_bias_body, 2)


def test_bias_update_refusals():
    plain = MoELayer(_cfg())
    with pytest.raises(ValueError, match="no MoE layer .* score-correction bias"):
        balance.update_expert_bias(plain, 1e-3)
    biased = MoELayer(_cfg(score_correction_bias=True))
    for bad in (0.0, -1e-3, float("inf"), True):
        with pytest.raises(ValueError, match="rate must be a positive finite number"):
            balance.update_expert_bias(biased, bad)
    biased.router.e_score_correction_bias = biased.router.e_score_correction_bias.bfloat16()
    with pytest.raises(TypeError, match="keep it in float32"):
        balance.update_expert_bias(biased, 1e-3)
    with pytest.raises(ValueError, match="has no MoE layer"):
        balance.end_load_step(torch.nn.Linear(2, 2))


# ---- configuration and call errors ----------------------------------------------------------


@pytest.mark.parametrize("kw,match", [
    (dict(aux_loss_coef=-0.1), "aux_loss_coef must be a finite number >= 0"),
    (dict(z_loss_coef=float("nan")), "z_loss_coef must be"),
    (dict(seq_aux_loss_coef=True), "seq_aux_loss_coef must be"),
    (dict(aux_loss_scope="global"), "aux_loss_scope must be one of"),
    (dict(aux_loss_scope="group"), "aux_loss_coef=0 leaves that loss off"),
])
def test_config_refuses_bad_balancing_options(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_balance_group_is_checked_against_the_config():
    with pytest.raises(ValueError, match="initialise torch.distributed"):
        MoELayer(_cfg(aux_loss_coef=0.1, aux_loss_scope="group"))
    with pytest.raises(ValueError, match="pass no balance_group"):
        MoELayer(_cfg(aux_loss_coef=0.1), balance_group=object())
    with pytest.raises(TypeError, match="balance_group must be"):
        MoELayer(_cfg(aux_loss_coef=0.1, aux_loss_scope="group"), balance_group="world")


def test_seq_len_is_checked_against_the_input_and_config():
    layer = MoELayer(_cfg(seq_aux_loss_coef=0.1))
    with pytest.raises(ValueError, match="does not divide the 6 tokens"):
        layer(torch.randn(6, H), seq_len=4)
    with pytest.raises(ValueError, match="holds sequences of 3 tokens"):
        layer(torch.randn(2, 3, H), seq_len=2)
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        layer(torch.randn(6, H), seq_len=0)
    with pytest.raises(ValueError, match="seq_aux_loss_coef=0: pass no seq_len"):
        MoELayer(_cfg())(torch.randn(6, H), seq_len=3)
