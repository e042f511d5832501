"""Converted models of every preset through pickle, torch.save/torch.load and copy.deepcopy,
after a training step, checkpointed or not: the copy computes bit for bit what the original
does (logits, loss, router logits, transformers' load-balancing loss, every gradient), keeps
moe_fn's hooks and the classes made at conversion, and still refuses a non-finite
score-correction bias on load."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_fn.hf import convert, converted_blocks
from moe_fn.hf.aux_loss import AuxLossHooks
from tests.dist_utils import run_distributed
from tests.hf.models import SUPPORTED, batch, make_model, preset_of, preset_params
from tests.round_trips import ROUND_TRIPS, assert_owns_its_tensors, assert_same_tensors

pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable:FutureWarning")


def _converted(name, ckpt, **options):
    model = convert(make_model(name), skip_recompute_combine=ckpt, **options)
    model.train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        # transformers' own hook making the embeddings' output require grad is a local
        # function, which no pickle takes (its unconverted models alike); the embedding's
        # trainable weight makes that output require grad anyway.
        model.disable_input_require_grads()
    return model


def _step(model, *, capture: bool, seed=0):
    """One forward (labels; the router logits and transformers' loss with ``capture``) and
    backward: what it computed. Capturing installs transformers' output-capture hooks,
    local functions that no pickle takes (in its unconverted models alike), so the step
    before a round trip does not capture."""
    model.zero_grad(set_to_none=True)
    ids, labels = batch(seed)
    torch.manual_seed(3)  # Mixtral's and MiniMax-M2's jitter, where it is on
    out = model(input_ids=ids, labels=labels, output_router_logits=capture, use_cache=False)
    out.loss.backward()
    got = {"logits": out.logits.detach(), "loss": out.loss.detach()}
    if capture:
        # Models whose output type has no router logits (DeepSeek-V3's in some transformers
        # versions) are compared on the rest.
        logits = getattr(out, "router_logits", None) or ()
        got |= {f"router_logits[{i}]": t.detach() for i, t in enumerate(logits)}
        aux = getattr(out, "aux_loss", None)
        got["aux_loss"] = None if aux is None else aux.detach()
    got |= {f"grad {n}": p.grad for n, p in model.named_parameters()}
    return got


def _aux_hooks(model):
    hooks = [h.__self__ for h in model._forward_pre_hooks.values()
             if isinstance(getattr(h, "__self__", None), AuxLossHooks)]
    return hooks[0] if hooks else None


# Checkpointed (HF's reentrant checkpointing, wrapped for replay, with the combine skip) for
# a few families: what it adds to a model's state (the wrapped checkpoint functions) does
# not depend on the preset.
def _case(name, ckpt):
    (skip,) = preset_params([name])[0].marks
    return pytest.param(name, ckpt, id=f"{name}-{'checkpointed' if ckpt else 'plain'}",
                        marks=skip)


CASES = [*(_case(n, False) for n in SUPPORTED),
         *(_case(n, True) for n in ("qwen3_moe", "deepseek_v3", "gpt_oss", "llama4"))]


@pytest.mark.parametrize(("name", "ckpt"), CASES)
def test_a_converted_model_that_trained_round_trips_whole(name, ckpt):
    model = _converted(name, ckpt)
    _step(model, capture=False)
    # Every copy made before the first capturing step (see _step).
    copies = {trip: round_trip(model) for trip, round_trip in ROUND_TRIPS.items()}
    for trip, copied in copies.items():
        what = f"{name} after {trip}"
        assert type(copied) is type(model)
        assert_owns_its_tensors(copied, model)
        assert_same_tensors(copied.state_dict(), model.state_dict(), what)
        blocks, own = converted_blocks(copied), converted_blocks(model)
        assert [(n, type(b)) for n, b in blocks] == [(n, type(b)) for n, b in own], what
        hooks = _aux_hooks(copied)
        assert (hooks is None) == (_aux_hooks(model) is None), what
        for (_, block), (_, theirs) in zip(blocks, own):
            layer = block.moe_layer
            # The copy's layer reads the copy's own parameters, and its model's loss hooks.
            assert layer.router._block is block and layer.experts._block is block, what
            assert block.__dict__["_moe_fn_aux"] is hooks, what
            assert layer.exchange.counters == theirs.moe_layer.exchange.counters, what
    want = _step(model, capture=True)
    counters = [dict(b.moe_layer.exchange.counters) for _, b in converted_blocks(model)]
    if ckpt:  # the recompute replayed the route and skipped the combine
        assert all(c["cached_dispatch"] and c["combine_skipped"] for c in counters), counters
    for trip, copied in copies.items():
        assert_same_tensors(_step(copied, capture=True), want, f"{name} after {trip}")
        assert [dict(b.moe_layer.exchange.counters)
                for _, b in converted_blocks(copied)] == counters, f"{name} after {trip}"


BIASED = [n for n in SUPPORTED if preset_of(n).bias_attr is not None]


@pytest.mark.parametrize("trip", ROUND_TRIPS)
@pytest.mark.parametrize("name", preset_params(BIASED))
def test_a_round_trip_still_refuses_a_nonfinite_bias_on_load(name, trip):
    copied = ROUND_TRIPS[trip](convert(make_model(name)))
    sd = copied.state_dict()
    key = next(k for k in sd if k.endswith("e_score_correction_bias"))
    sd[key] = sd[key].clone()
    sd[key].view(-1)[2] = float("nan")
    with pytest.raises(ValueError, match=r"e_score_correction_bias.*non-finite.*experts \[2\]"):
        copied.load_state_dict(sd)
    # The refusal came before anything was copied in.
    assert torch.isfinite(copied.state_dict()[key]).all()


def test_a_deep_copy_of_a_block_alone_keeps_its_layer_on_its_own_parameters():
    """A converted block copied alone (not its model) computes as the original and reads its
    own copies of the parameters."""
    model = convert(make_model("qwen3_moe"))
    name, block = converted_blocks(model)[0]
    twin = copy.deepcopy(block)
    assert twin.moe_layer.router._block is twin
    assert twin.moe_layer.experts.gate_up_proj is twin.experts.gate_up_proj
    x = torch.randn(2, 3, block.moe_layer.config.hidden_size,
                    generator=torch.Generator().manual_seed(0))
    assert torch.equal(twin(x), block(x)), name


def _ep_body(rank, world):
    model = _converted("qwen3_moe", False, ep_size=world)  # on the default group
    _step(model, capture=False, seed=rank)
    copies = {trip: round_trip(model) for trip, round_trip in ROUND_TRIPS.items()}
    want = _step(model, capture=True, seed=rank)
    for trip, copied in copies.items():
        layer = converted_blocks(copied)[0][1].moe_layer
        assert (layer.ep_rank, layer.config.ep_size) == (rank, world), trip
        assert_same_tensors(_step(copied, capture=True, seed=rank), want,
                            f"rank {rank} after {trip}")


@pytest.mark.multiproc
def test_an_expert_parallel_converted_model_round_trips_on_each_rank():
    """Each rank's model (its experts' slice, the exchange over the default group) copies
    and loads on its rank and trains as the original, collectives included."""
    run_distributed(_ep_body, 2)
