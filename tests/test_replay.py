"""Activation checkpointing: routing replay and the recompute-combine skip."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from attrs import evolve as attrs_evolve
from torch import nn

import moe_fn
from moe_fn import MoEConfig, MoELayer
from moe_fn.skip_check import SkipContractError
from moe_fn.testing import (
    assert_close_to_ref,
    assert_jointly_close_to_ref,
)
from tests import fake_deep_ep
from tests.dist_utils import run_distributed
from tests.naive import naive_layers

H, I, E = 8, 6, 4


class Block(nn.Module):
    """``h + moe(h @ A)``: the MoE output feeds only the residual add."""

    def __init__(self, cfg, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = nn.Parameter(torch.eye(H) + 0.1 * torch.randn(H, H, generator=g))
        self.moe = MoELayer(cfg)
        with torch.no_grad():
            # Every rank builds the full expert set from one seed and keeps its slice. Gains
            # near one keep three steps' activations and gradients well conditioned (larger
            # ones grow them until the float32 gradients are rounding noise).
            full_gu = 0.3 * torch.randn(E, 2 * I, H, generator=g)
            full_dn = 0.3 * torch.randn(E, H, I, generator=g)
            r, el = self.moe.ep_rank, cfg.num_local_experts
            self.moe.router.weight.copy_(torch.randn(E, H, generator=g))
            self.moe.experts.gate_up_proj.copy_(full_gu[r * el:(r + 1) * el])
            self.moe.experts.down_proj.copy_(full_dn[r * el:(r + 1) * el])

    def forward(self, h):
        return h + self.moe(h @ self.proj)


def make_model(cfg, dtype=torch.float32):
    torch.manual_seed(0)
    return nn.ModuleList([Block(cfg, 10), Block(cfg, 11)]).to(dtype)


def naive_step(model, x, dtype):
    """The step's outputs and gradients of ``model``'s twin in ``dtype`` with every layer
    the reference MoE, at the model's current parameters and input ``x``."""
    twin = copy.deepcopy(model).to(dtype)
    twin.zero_grad()
    h = xt = x.detach().to(dtype).requires_grad_()
    with naive_layers():
        for b in twin:
            h = b(h)
    (h * torch.linspace(-1, 1, H, dtype=dtype)).sum().backward()
    return {"h": h.detach(), "x_grad": xt.grad, **{n: p.grad for n, p in twin.named_parameters()}}


def run_steps(cfg, mode, steps=3, tokens=64, rank=0, dtype=torch.float32, oracle=False):
    """Three SGD steps; the router's large learning rate changes routes between steps (the
    loss sums over tokens, so the rates are per token). Enough tokens that the largest
    rounding error of each gradient is a maximum over many, comparable between summation
    orders and machines. With ``oracle`` (one rank) each step's record also holds
    ``naive_step``'s results at that step's parameters: ``"plain"`` in ``dtype``,
    ``"ref64"`` in float64."""
    model = make_model(cfg, dtype)
    opt = torch.optim.SGD([{"params": [b.moe.router.weight for b in model], "lr": 3.0 / tokens},
                           {"params": [p for b in model for n, p in b.named_parameters()
                                       if "router" not in n], "lr": 0.02 / tokens}])
    g = torch.Generator().manual_seed(100 + rank)
    probe = torch.randn(64, H, generator=torch.Generator().manual_seed(7))
    routes = []
    record = []
    for _ in range(steps):
        x = torch.randn(tokens, H, generator=g).to(dtype).requires_grad_()
        h = x
        for b in model:
            if mode == "none":
                h = b(h)
            else:
                h = moe_fn.checkpoint(b, h, use_reentrant=(mode == "reentrant"))
        loss = (h * torch.linspace(-1, 1, H, dtype=dtype)).sum()
        opt.zero_grad()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if dist.is_initialized():
            for n in grads:
                if "router" in n or "proj" in n:
                    dist.all_reduce(grads[n])
        assert torch.isfinite(loss)
        record.append({"h": h.detach().clone(), "x_grad": x.grad.clone(), **grads})
        if oracle:
            record[-1]["plain"] = naive_step(model, x, dtype)
            record[-1]["ref64"] = naive_step(model, x, torch.float64)
        with torch.no_grad():
            routes.append(model[0].moe.route(probe.to(dtype) @ model[0].proj)[1])
        opt.step()
    # The optimizer moved the routers far enough to change which experts tokens choose.
    assert not torch.equal(routes[0], routes[-1])
    return record, model


ORACLE = ("plain", "ref64")


def assert_steps_match_the_reference(record):
    """Each step of a ``run_steps(..., oracle=True)`` record against the reference MoE at
    that step's parameters, outputs and gradients taken as one (no drift of float32
    trajectories between steps enters the bound)."""
    for n, step in enumerate(record):
        names = list(step["plain"])
        assert_jointly_close_to_ref([step[k] for k in names],
                                    [step["plain"][k] for k in names],
                                    [step["ref64"][k] for k in names],
                                    [f"step {n} {k}" for k in names])


def assert_same(a, b, ref64):
    """Each step's outputs and gradients of ``a`` within twice the error of the unchecked
    run ``b`` (same precision) against the unchecked float64 run ``ref64``: recompute and the
    skipped combine may sum in other orders."""
    assert len(a) == len(b) == len(ref64)
    for n, (step_a, step_b, step_64) in enumerate(zip(a, b, ref64)):
        step_a, step_b, step_64 = ({k: v for k, v in step.items() if k not in ORACLE}
                                   for step in (step_a, step_b, step_64))
        assert step_a.keys() == step_b.keys() == step_64.keys()
        for k in step_a:
            assert_close_to_ref(step_a[k], step_b[k], step_64[k], f"step {n} {k}")


# impl="fused" weights inside the combine's sum; a skipped recompute weights on the expert
# side.
CASES = [dict(score_apply=s, impl=i) for s, i in
         itertools.product(["post", "pre"], ["reference", "fused"])]
CASES.append(dict(score_apply="activation"))


def _cfg(world, **kw):
    backend = dict(comm_backend="all_to_all", ep_size=world) if world > 1 else {}
    return MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2,
                     **{**backend, **kw})


def _check_cases(world, rank=0, **exchange_kw):
    routes_changed = False
    cases = [dict(c, **exchange_kw) for c in CASES]
    for kw in cases:
        # The checkpointed runs against the unchecked one; on one rank that one's every
        # step also against the reference MoE at that step's parameters.
        ref, _ = run_steps(_cfg(world, **kw), "none", rank=rank, oracle=world == 1)
        if world == 1:
            assert_steps_match_the_reference(ref)
        ref64, _ = run_steps(_cfg(world, **kw), "none", rank=rank, dtype=torch.float64)
        for mode, skip in [("reentrant", False), ("reentrant", True),
                           ("non_reentrant", False), ("non_reentrant", True)]:
            got, model = run_steps(_cfg(world, skip_recompute_combine=skip, **kw), mode,
                                   rank=rank)
            assert_same(got, ref, ref64)
            for b in model:
                c = b.moe.exchange.counters
                # Per step: one layout, one fresh dispatch, one cached dispatch (recompute).
                assert (c["layout"], c["dispatch"], c["cached_dispatch"]) == (3, 3, 3)
                skipped = skip and mode == "reentrant"
                if mode == "reentrant":
                    assert c["combine"] == (3 if skipped else 6), (mode, skip, dict(c))
                    assert c["combine_skipped"] == (3 if skipped else 0)
                else:
                    # Non-reentrant recompute stops once the saved tensors are rebuilt, and
                    # the skip is not applied there (outside the supported contract).
                    assert c["combine_skipped"] == 0 and c["combine"] >= 3
                assert c["combine_backward"] == 3 and c["dispatch_backward"] == 3
        for mode in ("reentrant", "non_reentrant"):
            # Not recomputed: the forward's activations serve the backward.
            got, model = run_steps(_cfg(world, recompute_in_checkpoint=False, **kw), mode,
                                   rank=rank)
            assert_same(got, ref, ref64)
            for b in model:
                c = b.moe.exchange.counters
                assert (c["layout"], c["dispatch"], c["cached_dispatch"], c["combine"],
                        c["combine_backward"], c["dispatch_backward"]) == (3, 3, 0, 3, 3, 3), \
                    (mode, dict(c))
        routes_changed = True
    assert routes_changed


def _check_recompute_routes_as_the_forward_did(world, rank=0, **kw):
    """Between a checkpointed forward and its backward the score-correction bias (choice
    only) moves to favour other experts: the recompute must still route as the forward
    did. Within an ordinary step a fresh choice would equal the recorded one, so this is
    what tells replay from routing again."""
    cfg = _cfg(world, score_correction_bias=True, **kw)
    gen = torch.Generator().manual_seed(20 + rank)
    x = torch.randn(8, H, generator=gen, dtype=torch.float64)
    g = torch.randn(8, H, generator=gen, dtype=torch.float64)

    def grads(mode, skip=False, move_bias=False):
        torch.manual_seed(0)
        layer = MoELayer(attrs_evolve(cfg, skip_recompute_combine=skip), dtype=torch.float64)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
        a = x.clone().requires_grad_()
        if mode == "none":
            out = layer(a)
        else:
            out = moe_fn.checkpoint(lambda t: t + layer(t), a,
                                    use_reentrant=mode == "reentrant") - a
        before = layer.route(a.detach())[1]
        if move_bias:
            with torch.no_grad():  # the experts chosen least now win every choice
                layer.router.e_score_correction_bias.copy_(
                    -100.0 * torch.bincount(before.flatten(), minlength=E).float())
            assert not torch.equal(layer.route(a.detach())[1], before)
        (out * g).sum().backward()
        return [a.grad] + [p.grad for p in layer.parameters()]

    want = grads("none")
    for mode, skip in [("reentrant", False), ("reentrant", True), ("non_reentrant", False)]:
        for got_g, want_g in zip(grads(mode, skip, move_bias=True), want):
            torch.testing.assert_close(got_g, want_g, msg=f"{mode} skip={skip}")


@pytest.mark.filterwarnings("ignore:skip_recompute_combine=True does not apply")
def test_replay_matches_unchecked_single_process():
    _check_cases(1)


def test_the_recompute_routes_as_the_forward_did():
    _check_recompute_routes_as_the_forward_did(1)


def _ep_body(rank, world):
    fake_deep_ep.install()
    _check_recompute_routes_as_the_forward_did(world, rank)
    _check_recompute_routes_as_the_forward_did(world, rank, comm_backend="deepep")
    _check_cases(world, rank)
    _check_cases(world, rank, comm_backend="deepep")
    _check_cases(world, rank, comm_backend="symm_mem")


@pytest.mark.multiproc
@pytest.mark.filterwarnings("ignore:skip_recompute_combine=True does not apply")
def test_replay_matches_unchecked_expert_parallel():
    run_distributed(_ep_body, 2)


def test_stale_entry_from_an_earlier_step_is_never_replayed():
    """Step 1 records entries but never runs backward; step 2 must route afresh.

    A per-layer queue of entries (the unprotected design) would replay step 1's route in
    step 2's recompute and give step 2 wrong gradients."""
    cfg = _cfg(1, skip_recompute_combine=True)
    torch.manual_seed(3)
    x1, x2 = torch.randn(6, H), torch.randn(6, H)

    def step(model, x, mode):
        x = x.clone().requires_grad_()
        h = x
        for b in model:
            h = b(h) if mode == "none" else moe_fn.checkpoint(b, h)
        (h * torch.linspace(-1, 1, H)).sum().backward()
        return x.grad, [p.grad.clone() for p in model.parameters()]

    ref = make_model(cfg)
    with torch.no_grad():
        for b in ref:
            b.moe.router.weight.mul_(-1.0)  # step 2's routes differ from step 1's
    with naive_layers():  # the reference MoE: float64 the oracle, float32 plain
        want64 = step(copy.deepcopy(ref).double(), x2.double(), "none")
        want = step(ref, x2, "none")

    model = make_model(cfg)
    h = x1.clone().requires_grad_()
    for b in model:
        h = moe_fn.checkpoint(b, h)  # forward only: the entries are abandoned with the graph
    del h
    with torch.no_grad():
        for b in model:
            b.moe.router.weight.mul_(-1.0)
    got = step(model, x2, "checkpoint")
    assert_jointly_close_to_ref([got[0], *got[1]], [want[0], *want[1]], [want64[0], *want64[1]])


def test_skip_with_output_used_beyond_the_residual_add_is_refused():
    """A nonlinear consumer of the skipped output (whose NaN sentinel gave non-finite
    gradients without an error) is refused in the recompute, naming the op and the fixes
    (tests/test_skip_check.py has the whole list)."""
    cfg = _cfg(1, skip_recompute_combine=True)
    model = make_model(cfg)
    b = model[0]

    def misuse(h):
        return h + torch.tanh(b.moe(h @ b.proj)) * 2

    x = torch.randn(6, H, requires_grad=True)
    out = moe_fn.checkpoint(misuse, x)
    with pytest.raises(SkipContractError, match=r"(?s)skip_recompute_combine=True.*"
                       r"TanhBackward0.*skip_recompute_combine=False.*"
                       r"recompute_in_checkpoint=False"):
        out.sum().backward()
    assert x.grad is None and b.proj.grad is None


def test_skip_under_a_non_reentrant_checkpoint_warns_once_per_layer():
    """The skip needs a reentrant recompute; moe_fn.checkpoint(use_reentrant=False) replays
    without it, and says so once (as the HF path does when it is enabled)."""
    import warnings

    model = make_model(_cfg(1, skip_recompute_combine=True))
    x = torch.randn(6, H, requires_grad=True)
    for step in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            moe_fn.checkpoint(lambda h: model[1](model[0](h)), x,
                              use_reentrant=False).sum().backward()
        said = [w for w in caught if "does not apply under a non-reentrant" in str(w.message)]
        assert len(said) == (2 if step == 0 else 0)  # one per layer, first step only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moe_fn.checkpoint(model[1], moe_fn.checkpoint(model[0], x)).sum().backward()


def _two_layers_one_region(skip, chained, dtype=torch.float32):
    model = make_model(_cfg(1, skip_recompute_combine=skip), dtype)

    def region(h):
        if chained:  # Megatron-Core's several layers per region: l1's output feeds l2
            return model[1](model[0](h))
        return h + model[0].moe(h @ model[0].proj) + model[1].moe(h @ model[1].proj)

    x = torch.randn(6, H, generator=torch.Generator().manual_seed(3)).to(dtype)
    return model, region, x.requires_grad_()


def test_skip_refuses_chained_moe_layers_in_one_region():
    """Unchecked, l1's recomputed NaN sentinel would feed l2 and every gradient would become
    NaN with no error: refused in the recompute, naming the fix."""
    _, region, x = _two_layers_one_region(True, chained=True)
    out = moe_fn.checkpoint(region, x)
    with pytest.raises(SkipContractError, match="Checkpoint one MoE layer per region"):
        out.sum().backward()


@pytest.mark.parametrize("skip,chained", [(True, False), (False, True)],
                         ids=["skip_parallel", "replay_chained"])
def test_several_moe_layers_in_one_region_when_valid(skip, chained):
    """Layers side by side (each output only in the residual add) may skip; chained layers
    replay without the skip. Both match the reference MoE."""
    model, region, x = _two_layers_one_region(skip, chained)
    with naive_layers():  # the reference MoE: float32 plain, float64 the oracle
        want_out = region(x)
        want_out.sum().backward()
        want = [want_out.detach(), x.grad.clone(),
                *[p.grad.clone() for p in model.parameters()]]
        model64, region64, x64 = _two_layers_one_region(skip, chained, torch.float64)
        out64 = region64(x64)
        out64.sum().backward()
    want64 = [out64.detach(), x64.grad, *[p.grad for p in model64.parameters()]]
    x.grad = None
    model.zero_grad()
    out = moe_fn.checkpoint(region, x)
    out.sum().backward()
    assert_jointly_close_to_ref([out.detach(), x.grad, *[p.grad for p in model.parameters()]],
                                want, want64)
    counters = [b.moe.exchange.counters for b in model]
    # One layout in the forward; the recompute replays it (a cached dispatch).
    assert all(c["cached_dispatch"] == 1 and c["layout"] == 1 for c in counters)
    assert all(c["combine_skipped"] == int(skip) for c in counters)


def test_skip_with_output_written_in_place_raises():
    """The sentinel is a view the skipped combine returns: autograd refuses an in-place
    write into it at once, and the refusal names the skip."""
    cfg = _cfg(1, skip_recompute_combine=True)
    b = make_model(cfg)[0]

    def misuse(h):
        y = b.moe(h @ b.proj)
        y.mul_(2.0)  # fine in the first forward, impossible on the recompute's sentinel
        return h + y

    x = torch.randn(6, H, requires_grad=True)
    out = moe_fn.checkpoint(misuse, x)
    with pytest.raises(SkipContractError, match="skip_recompute_combine=True.*modified inplace"):
        out.sum().backward()


def test_skip_sentinel_is_one_contiguous_nan_buffer_shared_by_layers():
    """The recompute's sentinels are contiguous views of one NaN buffer (the residual add
    then takes PyTorch's vectorised path), reused by every layer and every step."""
    moe_fn.release_comm_resources()  # a fresh buffer, whatever earlier tests left
    model = make_model(_cfg(1, skip_recompute_combine=True))
    seen = []

    def grab(module, args, out):
        if not torch.is_grad_enabled():  # the reentrant forward; the recompute has grad
            return
        seen.append(out)
    hooks = [b.moe.register_forward_hook(grab) for b in model]
    for tokens in (6, 4, 9):  # a smaller batch reuses the buffer's leading rows; a larger
        # one grows it
        x = torch.randn(tokens, H, requires_grad=True)
        h = x
        for b in model:
            h = moe_fn.checkpoint(b, h)
        h.sum().backward()
        assert torch.isfinite(x.grad).all()
    for hk in hooks:
        hk.remove()
    assert [tuple(o.shape) for o in seen] == [(6, H)] * 2 + [(4, H)] * 2 + [(9, H)] * 2
    assert all(o.is_contiguous() and torch.isnan(o).all() for o in seen)
    first, grown = ({o.untyped_storage().data_ptr() for o in part}
                    for part in (seen[:4], seen[4:]))
    assert len(first) == 1 and len(grown) == 1 and first != grown


def test_skip_sentinel_written_in_place_under_no_grad_raises_and_is_refilled():
    """Written in place under no_grad, the sentinel is refused by autograd when next used,
    and the next recompute gets NaN again rather than what was written into the buffer."""
    b = make_model(_cfg(1, skip_recompute_combine=True))[0]

    def misuse(h):
        y = b.moe(h @ b.proj)
        with torch.no_grad():
            y.zero_()
        return h + y

    x = torch.randn(6, H, requires_grad=True)
    with pytest.raises(SkipContractError, match="skip_recompute_combine=True.*modified inplace"):
        moe_fn.checkpoint(misuse, x).sum().backward()
    seen = []
    hook = b.moe.register_forward_hook(
        lambda m, a, out: seen.append(out) if torch.is_grad_enabled() else None)
    x.grad = None
    moe_fn.checkpoint(b, x).sum().backward()
    hook.remove()
    assert len(seen) == 1 and torch.isnan(seen[0]).all()
    assert torch.isfinite(x.grad).all()


def test_checkpoint_mode_must_be_a_bool():
    """torch reads use_reentrant=None as True; replay, the skip and kept layers would read
    it as False: refused rather than read two ways."""
    b = make_model(_cfg(1))[0]
    x = torch.randn(6, H, requires_grad=True)
    with pytest.raises(TypeError, match="use_reentrant must be True or False"):
        moe_fn.checkpoint(b, x, use_reentrant=None)
    with pytest.raises(TypeError, match="use_reentrant must be True or False"):
        moe_fn.replay.wrap_checkpoint(torch.utils.checkpoint.checkpoint, use_reentrant=None)
    with pytest.raises(TypeError, match="first argument must be the function"):
        moe_fn.checkpoint(x, x)


def test_replay_entries_are_consumed_once():
    cfg = _cfg(1)
    model = make_model(cfg)
    x = torch.randn(6, H, requires_grad=True)
    out = moe_fn.checkpoint(model[0], x)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="consumed once"):
        out.sum().backward()


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("recompute_in_checkpoint", [True, False])
def test_a_recompute_calling_fewer_layers_is_refused(reentrant, recompute_in_checkpoint):
    """The forward calls a layer twice, the recompute once: refused at the recompute (its
    gradients would come from a graph without the second call), as one calling more or
    other layers is."""
    layer = make_model(_cfg(1, recompute_in_checkpoint=recompute_in_checkpoint))[0]
    calls = []

    def fn(v):
        calls.append(1)
        v = v + layer(v)
        return v + layer(v) if len(calls) == 1 else v

    x = torch.randn(6, H, requires_grad=True)
    out = moe_fn.checkpoint(fn, x, use_reentrant=reentrant)
    with pytest.raises(RuntimeError, match="recompute called 1 MoE layer.*forward called 2"):
        out.sum().backward()


def test_kept_layer_gets_its_gradients_when_its_input_needs_none():
    """Reentrant checkpoint, recompute_in_checkpoint=False, the MoE input a constant: the
    recompute's node must still run the kept graph, or the router and experts get no
    gradient at all."""
    grads = []
    for kept in (False, True):
        b = make_model(_cfg(1, recompute_in_checkpoint=not kept))[0]
        c = torch.randn(6, H, generator=torch.Generator().manual_seed(3))  # no grad
        x = torch.randn(6, H, generator=torch.Generator().manual_seed(4)).requires_grad_()
        if kept:
            out = moe_fn.checkpoint(lambda h, b=b, c=c: h + b.moe(c), x)
        else:  # the reference MoE: float32 plain
            with naive_layers():
                out = x + b.moe(c)
        (out * torch.linspace(-1, 1, H)).sum().backward()
        grads.append([b.moe.router.weight.grad, b.moe.experts.gate_up_proj.grad,
                      b.moe.experts.down_proj.grad])
        if not kept:  # the reference MoE in float64: the oracle
            b64 = copy.deepcopy(b).double()
            b64.zero_grad()
            with naive_layers():
                (x.detach().double() + b64.moe(c.double())) \
                    .mul(torch.linspace(-1, 1, H, dtype=torch.float64)).sum().backward()
            grads64 = [b64.moe.router.weight.grad, b64.moe.experts.gate_up_proj.grad,
                       b64.moe.experts.down_proj.grad]
    for got in grads[1]:
        assert got is not None and got.abs().sum() > 0
    assert_jointly_close_to_ref(grads[1], grads[0], grads64)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_without_autograd_runs_the_plain_forward(ctx, reentrant):
    b = make_model(_cfg(1, recompute_in_checkpoint=False))[0]
    x = torch.randn(6, H)
    with ctx():
        want = b(x)
        got = moe_fn.checkpoint(b, x, use_reentrant=reentrant)
    assert torch.equal(got, want)  # the same forward on the same input
