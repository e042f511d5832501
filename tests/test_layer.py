"""MoELayer: single process against the dense float64 reference (moe_fn.testing); expert
parallelism over gloo against the reference holding every expert (tests/ep_cases.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe_fn.layer
from moe_fn import MoEConfig, MoELayer
from moe_fn.comm import collectives
from moe_fn.testing import MoEParams, assert_close_to_ref, reference_moe
from tests import fake_deep_ep
from tests.dist_utils import run_distributed
from tests.ep_cases import EP_CASES, ep_case
from tests.ep_cases import randomize as _randomize
from tests.ep_cases import small_config as _cfg


@pytest.mark.parametrize("kw", [
    dict(),
    dict(score_apply="pre"),
    dict(score_apply="activation", activation="swiglu_oai", gate_up_layout="interleaved"),
    dict(gate_up_impl="separate", activation="geglu_tanh", score_func="sigmoid"),
    dict(activation="swiglu_clamped", activation_limit=0.05, norm_topk_prob=False,
         routed_scaling_factor=2.5),
    # GPT-OSS: router and expert biases, softmax over the top-k logits.
    dict(router_bias=True, expert_bias=True, score_func="softmax_topk", norm_topk_prob=False,
         activation="swiglu_oai", gate_up_layout="interleaved"),
    dict(expert_bias=True, gate_up_impl="separate", impl="reference"),
    # DeepSeek-V3 / MiniMax: a score-correction bias steers the choice, not the weights.
    dict(score_correction_bias=True, score_func="sigmoid", norm_topk_prob=True),
])
def test_layer_matches_the_reference(kw):
    torch.manual_seed(0)
    cfg = _cfg(**kw)
    layer = MoELayer(cfg, dtype=torch.float64)
    _randomize(layer)
    choice_bias = None
    if cfg.score_correction_bias:
        choice_bias = torch.randn(4, generator=torch.Generator().manual_seed(1))
        layer.router.e_score_correction_bias.copy_(choice_bias)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    out, logits = layer(x, return_router_logits=True)
    if choice_bias is not None:  # the bias changed some token's choice
        assert not torch.equal(layer.route(x.detach().reshape(-1, 8))[1],
                               _unbiased(layer).route(x.detach().reshape(-1, 8))[1])
    g = torch.randn_like(out)
    (out * g).sum().backward()

    mods = (layer.router.weight, layer.experts.gate_up_proj, layer.experts.down_proj,
            layer.router.bias, layer.experts.gate_up_proj_bias, layer.experts.down_proj_bias)
    params = [None if p is None else p.detach().clone().requires_grad_() for p in mods]
    x2 = x.detach().clone().requires_grad_()
    ref, ref_logits, _ = reference_moe(x2.reshape(-1, 8), MoEParams(
        *params[:4], choice_bias, *params[4:]), cfg)
    (ref.reshape(out.shape) * g).sum().backward()
    torch.testing.assert_close(out, ref.reshape(out.shape))
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(x.grad, x2.grad)
    for p, r in zip(mods, params):
        if p is not None:
            torch.testing.assert_close(p.grad, r.grad)


def _unbiased(layer):
    copy_ = MoELayer(layer.config, dtype=torch.float64)
    copy_.load_state_dict(layer.state_dict())
    copy_.router.e_score_correction_bias.zero_()
    return copy_


def test_biases_are_parameters_and_need_post_weighting():
    layer = MoELayer(_cfg(router_bias=True, expert_bias=True))
    names = dict(layer.named_parameters())
    assert names["router.bias"].shape == (4,)
    assert names["experts.gate_up_proj_bias"].shape == (4, 12)
    assert names["experts.down_proj_bias"].shape == (4, 8)
    assert "router.bias" not in dict(MoELayer(_cfg()).named_parameters())
    for apply in ("pre", "activation"):
        with pytest.raises(ValueError, match="expert_bias needs score_apply='post'"):
            _cfg(expert_bias=True, score_apply=apply)
    _cfg(router_bias=True, score_apply="activation")  # a router bias works with any
    with pytest.raises(ValueError, match="expert_bias must be a bool"):
        _cfg(expert_bias=1)


def test_counters_one_of_each_per_forward():
    cfg = _cfg()
    layer = MoELayer(cfg)
    layer(torch.randn(7, 8, requires_grad=True)).sum().backward()
    c = layer.exchange.counters
    assert (c["layout"], c["dispatch"], c["cached_dispatch"], c["combine"]) == (1, 1, 0, 1)
    assert (c["dispatch_backward"], c["combine_backward"]) == (1, 1)


def test_bad_input_errors():
    layer = MoELayer(_cfg())
    with pytest.raises(ValueError, match="hidden_size=8"):
        layer(torch.randn(3, 7))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., hidden_size=8\)"):
        layer(torch.tensor(1.0))
    with pytest.raises(TypeError, match="return_router_logits must be a bool"):
        layer(torch.randn(3, 8), return_router_logits="no")
    with pytest.raises(ValueError, match="x is on the meta device"):
        layer(torch.randn(3, 8, device="meta"))
    with pytest.raises(RuntimeError, match="init_process_group"):
        MoELayer(_cfg(comm_backend="all_to_all", ep_size=2))


def test_parameters_changed_behind_the_config_are_refused():
    """Parameters replaced or cast piecemeal after the layer was built are caught at the
    call, not inside a GEMM or (worse) accepted with a wrong route."""
    x = torch.randn(3, 8)
    layer = MoELayer(_cfg())
    layer.router.weight = torch.nn.Parameter(torch.randn(3, 8))  # one expert short
    with pytest.raises(ValueError, match=r"router.weight must be \(4, 8\)"):
        layer(x)
    layer = MoELayer(_cfg())
    layer.experts.down_proj = torch.nn.Parameter(torch.randn(3, 8, 4))
    with pytest.raises(ValueError, match="experts.down_proj must be"):
        layer(x)
    layer = MoELayer(_cfg())
    layer.router.float()  # the rest stays float32 too: fine
    layer(x)
    layer.router.double()
    with pytest.raises(TypeError, match="router.weight is torch.float64.*layer.to"):
        layer(x)


@pytest.mark.parametrize("name,option", [("router.bias", "router_bias"),
                                         ("router.e_score_correction_bias",
                                          "score_correction_bias"),
                                         ("experts.gate_up_proj_bias", "expert_bias"),
                                         ("experts.down_proj_bias", "expert_bias")])
def test_biases_must_match_the_config(name, option):
    """A bias the config asks for that is gone, one it does not ask for that was added, or
    one of the wrong shape is refused at the call, not dropped, added or broadcast."""
    x = torch.randn(3, 8)
    owner_name, attr = name.split(".")
    for wanted in (True, False):
        layer = MoELayer(_cfg(**{option: wanted}))
        owner = getattr(layer, owner_name)
        if wanted:
            present = getattr(owner, attr)
            setattr(owner, attr, None)
            with pytest.raises(ValueError, match=f"{name} is missing.*{option}=True"):
                layer(x)
            setattr(owner, attr, torch.nn.Parameter(present.detach()[..., :1]))
            with pytest.raises(ValueError, match=f"{name} must be"):
                layer(x)
        else:
            shape = {"router": (4,), "experts": (2, 8)}[owner_name]
            setattr(owner, attr, torch.nn.Parameter(torch.zeros(shape)))
            with pytest.raises(ValueError, match=f"{name} is set.*{option}=False"):
                layer(x)


@pytest.mark.parametrize("attr", ["gate_up_proj_bias", "down_proj_bias"])
def test_expert_biases_must_have_the_inputs_dtype_and_device(attr):
    """The layer calls the experts' shell without functional.experts' checks, so its own
    check covers what those did for the biases: x's dtype and device."""
    x = torch.randn(3, 8)
    layer = MoELayer(_cfg(expert_bias=True))
    bias = getattr(layer.experts, attr)
    setattr(layer.experts, attr, torch.nn.Parameter(bias.detach().double()))
    with pytest.raises(TypeError, match=f"experts.{attr} is torch.float64 but x is torch.float32"):
        layer(x)
    setattr(layer.experts, attr, torch.nn.Parameter(bias.detach().to("meta")))
    with pytest.raises(ValueError, match=f"experts.{attr} is on meta but x is on cpu"):
        layer(x)


# ---- expert parallelism over gloo ---------------------------------------------------------

def _ep_body(rank, world, tokens_per_rank):
    fake_deep_ep.install()  # comm_backend="deepep" over gloo, in this process
    # One process group runs every case: spawning processes dominates the test's time.
    for exchange_kw in EXCHANGES:
        for n, kw in enumerate(EP_CASES):
            kw = dict(kw)
            if kw["top_k"] == "E/ep":
                kw["top_k"] = kw["num_experts"] // world
            ep_case(rank, world, kw, tokens_per_rank, 1234 + n, exchange_kw)


# Every exchange (on CPUs the symm_mem exchange pulls from a gathering stand-in for
# symmetric memory: the same index logic).
# impl="fused" (the default) weights inside each exchange's sum: at home over all_to_all,
# on the expert side over symm_mem and DeepEP; "reference" weights the rows first.
EXCHANGES = [dict(), dict(impl="reference"), dict(comm_backend="symm_mem"),
             dict(comm_backend="symm_mem", impl="reference"),
             # DeepEP's own logic (tokens once per rank, expanded into expert rows, combined
             # in its sums) over tests/fake_deep_ep.py's stand-in for its Buffer.
             dict(comm_backend="deepep")]


TOKENS = {2: [6, 4], 4: [5, 3, 0, 6], 8: [5, 3, 0, 6, 2, 7, 1, 4]}


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4, 8])
def test_expert_parallel_matches_single_process(world):
    # Worlds 4 and 8 include a rank with no tokens of its own.
    run_distributed(_ep_body, world, TOKENS[world])


def _router_only_body(rank, world):
    """Only the routing weights need a gradient (frozen experts, an input without grad):
    the home-weighted combine must still keep what its backward needs. Router gradients
    (summed over the ranks) of both impls against the reference MoE holding every expert
    and every rank's tokens: float64 the oracle, float32 plain PyTorch."""
    xs = [torch.randn(6 + r, 16, generator=torch.Generator().manual_seed(r))
          for r in range(world)]
    grads = {}
    for impl in ("fused", "reference"):
        cfg = MoEConfig(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2,
                        comm_backend="all_to_all", ep_size=world, impl=impl)
        torch.manual_seed(5)
        layer = MoELayer(cfg)
        layer.experts.requires_grad_(False)
        layer(xs[rank]).square().sum().backward()
        grads[impl] = layer.router.weight.grad
        dist.all_reduce(grads[impl])
    experts = []
    for t in (layer.experts.gate_up_proj, layer.experts.down_proj):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.detach())
        experts.append(torch.cat(parts))
    full = MoEConfig(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2)
    for dtype in (torch.float32, torch.float64):
        router = layer.router.weight.detach().to(dtype).requires_grad_()
        ref = reference_moe(torch.cat(xs).to(dtype),
                            MoEParams(router, *(t.to(dtype) for t in experts)), full)
        ref.out.square().sum().backward()
        grads[dtype] = router.grad
    for impl in ("fused", "reference"):
        assert_close_to_ref(grads[impl], grads[torch.float32], grads[torch.float64], impl)
    assert grads["fused"].abs().sum() > 0


@pytest.mark.multiproc
def test_a_combine_whose_weights_alone_need_grad_keeps_its_rows():
    run_distributed(_router_only_body, 2)


def test_a_combine_told_no_backward_refuses_one():
    from moe_fn.autograd.routing import Combine

    layer = MoELayer(MoEConfig(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2))
    x = torch.randn(5, 8)
    _, idx, w = layer.route(x)
    plan = moe_fn.layer.make_route_plan(idx, 4)
    ex = layer.exchange
    rows, _, handle = ex.dispatch(x, None, ex.layout(plan))
    out = Combine.apply(rows.requires_grad_(), ex, handle, w, False)
    with pytest.raises(RuntimeError, match="needs_grad=False"):
        out.sum().backward()


def test_cuda_graph_capture_is_refused_where_host_work_would_be_frozen():
    from moe_fn.layer_checks import check_capturable

    layer = MoELayer(MoEConfig(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2))
    check_capturable(layer.exchange, None)  # local, no checkpoint: capturable
    with pytest.raises(RuntimeError, match="inside moe_fn.checkpoint"):
        check_capturable(layer.exchange, object())
    layer.exchange.backend = "all_to_all"
    with pytest.raises(RuntimeError, match="needs comm_backend='local'"):
        check_capturable(layer.exchange, None)


def _count_collectives_body(rank, world):
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        _count_collectives(world, dtype)


def _count_collectives(world, dtype):
    cfg = MoEConfig(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2,
                    comm_backend="all_to_all", ep_size=world,
                    impl="reference")  # the weights sent with the rows, weighted there
    layer = MoELayer(cfg, dist.group.WORLD, dtype=dtype)
    calls = []
    real, real_gather = dist.all_to_all_single, collectives.all_gather

    def counting(real):
        def call(*a, **kw):
            calls.append(a[0].shape)
            return real(*a, **kw)
        return call
    dist.all_to_all_single = counting(real)
    collectives.all_gather = counting(real_gather)
    try:
        x = torch.randn(6, 8, dtype=dtype, requires_grad=True)
        layer(x)
        first = len(calls)
        out = layer(x)
        forward = len(calls) - first
        # The ranks' agreement travels in the layout's counts gather: no collective of its
        # own, at the first call or later.
        assert first == forward, calls
        out.float().sum().backward()
        backward = len(calls) - first - forward
    finally:
        dist.all_to_all_single, collectives.all_gather = real, real_gather
    # Forward: the layout's counts, the rows with their routing weights packed in, the
    # combine; backward: the output gradient
    # out, the row gradients with the weight gradients packed in back (sent apart, the
    # weights would add one collective each way).
    assert (forward, backward) == (3, 2), calls
    assert calls[first + forward - 2][1] > 8 and calls[-1][1] > 8  # packed: wider rows
    assert torch.isfinite(x.grad).all() and layer.router.weight.grad.abs().sum() > 0


@pytest.mark.multiproc
def test_routing_weights_ride_in_the_rows_collective():
    run_distributed(_count_collectives_body, 2)


def _mismatch_body(rank, world, differ):
    kw = dict(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2,
              comm_backend="all_to_all", ep_size=world)
    dtype = torch.float32
    if rank == 1:
        if differ == "config":
            kw["top_k"] = 1
        else:
            dtype = torch.float64
    layer = MoELayer(MoEConfig(**kw), dist.group.WORLD, dtype=dtype)
    with pytest.raises(ValueError, match=f"rank 1 .* another {differ} than rank 0"):
        layer(torch.randn(5, 8, dtype=dtype))
    if differ == "dtype":  # each rank's layer in one dtype: agreed, and it runs
        layer.float()
        layer(torch.randn(5, 8))


def _later_mismatch_body(rank, world, backend):
    fake_deep_ep.install()
    kw = dict(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2,
              comm_backend=backend, ep_size=world)
    layer = MoELayer(MoEConfig(**kw), dist.group.WORLD)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))
    layer(x)  # both ranks agree on the first call
    # One rank alone changes dtype: every rank is told at the next call (no abort, no hang).
    if rank == 0:
        layer.to(torch.float64)
    with pytest.raises(ValueError, match="rank 1 .* another dtype than rank 0"):
        layer(x.to(torch.float64) if rank == 0 else x)
    layer.float()
    # One rank alone rebuilds its layer (same config, same weights): it simply runs on.
    want = layer(x)
    if rank == 1:
        fresh = MoELayer(MoEConfig(**kw), dist.group.WORLD)
        fresh.load_state_dict(layer.state_dict())
        layer = fresh
    torch.testing.assert_close(layer(x), want, rtol=0, atol=0)
    assert layer.exchange.counters["layout"] >= 1


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["all_to_all", "symm_mem", "deepep"])
def test_ranks_that_diverge_after_the_first_call_are_told_on_every_rank(backend):
    """The agreement travels in every fresh layout (the exchange's first collective), not
    once per layer and dtype: a rank whose dtype changed alone, or whose layer was rebuilt
    alone, meets the same collectives as the others (gloo aborted the process before)."""
    run_distributed(_later_mismatch_body, 2, backend)


@pytest.mark.multiproc
@pytest.mark.parametrize("differ", ["config", "dtype"])
def test_ranks_that_disagree_are_refused_before_the_exchange(differ):
    """Another config or dtype on one rank is named on every rank at the first call, before
    the exchange's collectives could mismatch (gloo aborted the process; rows of another
    dtype were reinterpreted bit for bit)."""
    run_distributed(_mismatch_body, 2, differ)


@pytest.mark.parametrize("rows_dtype,values_dtype", [
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
    (torch.float32, torch.float32), (torch.float64, torch.float32),
    (torch.float32, torch.float64), (torch.bfloat16, torch.float64),
    (torch.float32, torch.bfloat16)])
def test_packed_rows_carry_rows_and_values_exactly(rows_dtype, values_dtype):
    """What a packed collective delivers is bit for bit what was packed: the values ride as
    their own bytes (or an exact upcast), and packed rows stay 16-byte aligned."""
    from moe_fn.comm.packing import new_packed, pack_rows, unpack_rows

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(9, 13, generator=g).to(rows_dtype)
    values = torch.randn(11, 3, generator=g).to(values_dtype)
    values[0, 0] = float("nan")
    values[1, 1] = -0.0
    index = torch.tensor([4, 0, 8, 8, 2])
    v_index = torch.tensor([10, 1, 0, 5, 5])
    out = pack_rows(rows, index, values, v_index, new_packed(rows, 5, values))
    assert (out.shape[1] - rows.shape[1]) * out.element_size() % 16 == 0  # aligned tail
    got_rows, got_values = unpack_rows(out, values)
    assert torch.equal(got_rows, rows[index])
    assert got_values.dtype == values_dtype
    want = values[v_index]
    assert torch.equal(got_values.view(torch.int8), want.view(torch.int8))  # NaN, -0.0 too




def test_unpacked_values_can_be_gathered_straight_from_the_packed_bytes():
    from moe_fn.comm.packing import new_packed, pack_rows, unpack_rows

    g = torch.Generator().manual_seed(1)
    rows = torch.randn(6, 13, generator=g).to(torch.bfloat16)
    values = torch.randn(6, 1, generator=g)
    packed = pack_rows(rows, torch.arange(6), values, None, new_packed(rows, 6, values))
    order = torch.tensor([5, 0, 0, 3])
    _, got = unpack_rows(packed, values, order)
    assert torch.equal(got, values[order])
    _, none = unpack_rows(packed, values, order[:0])
    assert none.shape == (0, 1)


def test_unpacking_values_of_rows_that_are_not_there_raises():
    from moe_fn.comm.packing import new_packed, unpack_rows

    values = torch.zeros(0, 1)
    packed = new_packed(torch.zeros(0, 13, dtype=torch.bfloat16), 0, values)
    with pytest.raises((IndexError, RuntimeError)):
        unpack_rows(packed, values, torch.tensor([0]))


@pytest.mark.parametrize("values_dtype", [torch.float32, torch.float64])
def test_one_packed_row_of_odd_width_unpacks(values_dtype):
    """A single packed row is a contiguous slice whose values may start at an offset their
    dtype cannot view from (bf16 rows of odd width): unpacking copies them out."""
    from moe_fn.comm.packing import new_packed, pack_rows, unpack_rows

    rows = torch.randn(1, 7).to(torch.bfloat16)
    values = torch.randn(1, 8, dtype=values_dtype)
    packed = pack_rows(rows, torch.zeros(1, dtype=torch.long), values, None,
                       new_packed(rows, 1, values))
    got_rows, got_values = unpack_rows(packed, values)
    assert torch.equal(got_rows, rows) and torch.equal(got_values, values)


def test_cached_dispatch_of_other_tokens_is_refused():
    layer = MoELayer(MoEConfig(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2))
    x = torch.randn(6, 8)
    _, idx, w = layer.route(x)
    plan = moe_fn.layer.make_route_plan(idx, 4)
    handle = layer.exchange.layout(plan)
    layer.exchange.dispatch(x, w, handle, cached=True)  # the same tokens: fine
    with pytest.raises(ValueError, match="must move the 6 tokens its handle was made for"):
        layer.exchange.dispatch(x[:5], w[:5], handle, cached=True)


def test_reset_parameters_after_meta_construction_zeroes_the_choice_bias():
    """Built on the meta device, then given memory with to_empty() and initialised with
    reset_parameters(), a layer routes as one built directly (the score-correction bias
    is state the reset owns, not leftover memory)."""
    cfg = _cfg(score_correction_bias=True, score_func="sigmoid", router_bias=True,
               expert_bias=True)
    torch.manual_seed(0)
    direct = MoELayer(cfg)
    with torch.device("meta"):
        meta = MoELayer(cfg)
    meta = meta.to_empty(device="cpu")
    with torch.no_grad():
        for t in meta.buffers():
            t.fill_(float("nan"))  # whatever memory to_empty handed out
    torch.manual_seed(0)
    meta.reset_parameters()
    for (n, a), (_, b) in zip(direct.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), n
