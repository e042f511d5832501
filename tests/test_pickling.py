"""Whole MoELayers through pickle, torch.save/torch.load and copy.deepcopy: the copy computes
bit for bit what the original does (outputs, input and parameter gradients, balancing
losses, exchange counters), after the original has trained, in and out of checkpoints;
what holds a process group is shared by copies, saved as the default group, and refused
(by name) for any other group."""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
import torch.distributed as dist

import moe_fn
from moe_fn import MoEConfig, MoELayer
from tests import fake_deep_ep
from tests.dist_utils import run_distributed
from tests.round_trips import ROUND_TRIPS, assert_owns_its_tensors, assert_same_tensors

pytestmark = pytest.mark.filterwarnings(
    "ignore:skip_recompute_combine=True does not apply under a non-reentrant:UserWarning")

BASE = dict(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2)
SIGMOID_BIAS = dict(score_func="sigmoid", score_correction_bias=True, n_group=2,
                    topk_group=1, routed_scaling_factor=2.5)
CONFIGS = {
    "default": {},
    "reference": dict(impl="reference"),
    "score_correction_bias": SIGMOID_BIAS,
    "router_and_expert_biases": dict(router_bias=True, expert_bias=True,
                                     score_func="softmax_topk", norm_topk_prob=False,
                                     activation="swiglu_oai", activation_alpha=1.702,
                                     activation_limit=7.0, gate_up_layout="interleaved"),
    "score_apply_activation": dict(score_apply="activation", gate_up_impl="separate"),
    "score_apply_pre": dict(score_apply="pre", score_func="sigmoid", norm_topk_prob=False),
    "balancing_losses": dict(aux_loss_coef=0.01, seq_aux_loss_coef=0.02, z_loss_coef=0.001),
    "skip_recompute_combine": dict(skip_recompute_combine=True),
    "not_recomputed": dict(recompute_in_checkpoint=False, aux_loss_coef=0.01),
}
# How a step calls the layer: alone, or as the residual block h + layer(h) of a reentrant
# or non-reentrant moe_fn.checkpoint (routing replay; the skip and the kept layer).
CALLS = {"default": [None], "reference": [None], "score_correction_bias": [None, True],
         "router_and_expert_biases": [None], "score_apply_activation": [None],
         "score_apply_pre": [None], "balancing_losses": [None, False],
         "skip_recompute_combine": [True, False], "not_recomputed": [True, False]}


def make_layer(seed=0, group=None, **kw):
    torch.manual_seed(seed)
    layer = MoELayer(MoEConfig(**(BASE | kw)), group)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
        bias = layer.router.e_score_correction_bias
        if bias is not None:
            bias.normal_(0.0, 0.3)
    return layer


def step(layer, x, reentrant=None):
    """One forward and backward with a fixed output gradient; what it computed."""
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    if reentrant is None:
        y = layer(xi)
    else:
        y = moe_fn.checkpoint(lambda h: h + layer(h), xi, use_reentrant=reentrant)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)
    (y * g).sum().backward()
    got = {"out": y.detach(), "dx": xi.grad, "balance_loss": layer.balance_loss}
    got |= {f"grad {n}": p.grad for n, p in layer.named_parameters()}
    return got


def state(layer) -> dict:
    return {f"state {k}": v for k, v in layer.state_dict().items()}


def assert_same_layer(copied, layer, x, calls, what):
    """The copy holds what the original holds, and computes what it does."""
    assert type(copied) is type(layer) and copied.config == layer.config
    assert_owns_its_tensors(copied, layer)
    assert_same_tensors(state(copied), state(layer), what)
    assert copied.exchange.counters == layer.exchange.counters, what
    for reentrant in calls:
        assert_same_tensors(step(copied, x, reentrant), step(layer, x, reentrant),
                            f"{what} ({'alone' if reentrant is None else 'checkpointed'})")
        assert copied.exchange.counters == layer.exchange.counters, what


@pytest.mark.parametrize("trip", ROUND_TRIPS)
@pytest.mark.parametrize("name", CONFIGS)
def test_a_layer_that_trained_round_trips_whole(name, trip):
    layer = make_layer(**CONFIGS[name])
    layer.train()
    x = torch.randn(6, BASE["hidden_size"], generator=torch.Generator().manual_seed(1))
    for reentrant in CALLS[name]:  # the state a trained layer holds
        step(layer, x, reentrant)
    copied = ROUND_TRIPS[trip](layer)
    assert_same_layer(copied, layer, x, CALLS[name], f"{name} after {trip}")
    # The copy is the original's twin, not an alias: training it leaves the original.
    with torch.no_grad():
        copied.router.weight.add_(1.0)
    assert not torch.equal(copied.router.weight, layer.router.weight)
    # Both share the process's communication resources.
    assert copied.exchange.resources is layer.exchange.resources is moe_fn.resources.RESOURCES


@pytest.mark.parametrize("trip", ROUND_TRIPS)
def test_a_round_trip_still_refuses_a_nonfinite_bias_on_load(trip):
    copied = ROUND_TRIPS[trip](make_layer(**SIGMOID_BIAS))
    sd = copied.state_dict()
    sd["router.e_score_correction_bias"] = sd["router.e_score_correction_bias"].clone()
    sd["router.e_score_correction_bias"][1] = float("inf")
    with pytest.raises(ValueError, match=r"e_score_correction_bias.*non-finite.*experts \[1\]"):
        copied.load_state_dict(sd)


# ---- exchanges over gloo -------------------------------------------------------------------

EP_CONFIGS = {
    "all_to_all": dict(comm_backend="all_to_all"),
    "symm_mem": dict(comm_backend="symm_mem", impl="reference"),
    "deepep": dict(comm_backend="deepep"),
    "group_balance": dict(comm_backend="all_to_all", aux_loss_coef=0.01,
                          aux_loss_scope="group", overlap_weight_grad=True),
}


def _ep_body(rank, world, out_dir):
    fake_deep_ep.install()  # comm_backend="deepep" over gloo, in this process
    subgroup = dist.new_group(list(range(world)))  # every rank makes it
    x = torch.randn(5 + rank, BASE["hidden_size"], generator=torch.Generator().manual_seed(rank))
    blobs = {}
    for name, kw in EP_CONFIGS.items():
        for group in (None, dist.group.WORLD):
            layer = make_layer(seed=rank, group=group, ep_size=world, **kw)
            step(layer, x)
            step(layer, x, True)
            for trip, round_trip in ROUND_TRIPS.items():
                copied = round_trip(layer)
                what = f"rank {rank} {name} group {group} after {trip}"
                assert_same_layer(copied, layer, x, [None, True], what)
                assert copied.exchange.group is layer.exchange.group, what
                assert copied.balance.group is layer.balance.group, what
            blobs[name] = pickle.dumps(layer)
        # A group no other process can rebuild: copies share it, pickle refuses it by name.
        layer = make_layer(seed=rank, group=subgroup, ep_size=world, **kw)
        copied = copy.deepcopy(layer)
        assert copied.process_group is subgroup and copied.exchange.group is subgroup
        assert_same_layer(copied, layer, x, [None], f"rank {rank} {name} subgroup")
        with pytest.raises(TypeError, match=r"cannot pickle MoELayer\.process_group: it is a "
                                            r"process group other than the default one"):
            pickle.dumps(layer)
    # Each rank loads what it saved; another rank's layer (its experts) is refused.
    others = [None] * world
    dist.all_gather_object(others, blobs["all_to_all"])
    other = (rank + 1) % world
    with pytest.raises(RuntimeError, match=f"saved by rank {other} of {world} but is loaded "
                                           f"by rank {rank} of {world}"):
        pickle.loads(others[other])
    if rank == 0:
        for name, blob in blobs.items():
            with open(os.path.join(out_dir, name), "wb") as f:
                f.write(blob)


@pytest.mark.multiproc
def test_expert_parallel_layers_round_trip_on_the_default_group(tmp_path):
    run_distributed(_ep_body, 2, str(tmp_path))
    # Where torch.distributed is not initialised, a layer saved on a group cannot load.
    assert not dist.is_initialized()
    for name in ("all_to_all", "group_balance"):
        with pytest.raises(RuntimeError, match="initialise torch.distributed"):
            pickle.loads((tmp_path / name).read_bytes())
