"""transformers' own load-balancing loss of a converted model under HF's reentrant
checkpointing, against the unconverted model without checkpointing (float64 models); the
aux-loss-free bias update of converted models with a score-correction bias."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import moe_fn.balance as balance
from moe_fn.hf import convert, converted_blocks
from moe_fn.testing import assert_jointly_close_to_ref
from tests.hf.models import batch, keep_float64, make_model, preset_params

pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable:FutureWarning")

# The presets whose transformers model adds load_balancing_loss_func to its loss.
WITH_AUX_LOSS = ["qwen3_moe", "qwen2_moe", "qwen3_5_moe", "mixtral", "olmoe", "minimax_m2",
                 "minimax_m3", "gpt_oss", "qwen3_next", "qwen3_vl_moe", "ernie4_5_moe"]


def _model(name, converted=False, reentrant=None, **options):
    m = make_model(name).double()
    m.set_experts_implementation("eager")  # grouped_mm takes no float64
    if converted:
        convert(m, **options)
    m.train()
    if reentrant is not None:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return m


def _step(model, ids, labels=None, mask=None, scale=1.0):
    out = model(input_ids=ids, labels=labels, attention_mask=mask, output_router_logits=True,
                use_cache=False)
    ((out.loss if labels is not None else out.logits.square().mean()) * scale).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_against_hf(got, want, want64, name):
    """The converted model's (float64) gradients against transformers' float64 model run
    float64 throughout (``keep_float64``), with transformers' model as it runs (its routing
    softmax in float32) as plain: the tolerance rule, every gradient taken as one."""
    assert got.keys() == want.keys() == want64.keys()
    names = sorted(want)
    assert_jointly_close_to_ref([got[n] for n in names], [want[n] for n in names],
                                [want64[n] for n in names], [f"{name} grad {n}" for n in names])


def _step64(model, *args):
    with keep_float64():
        return _step(model, *args)


def _padding_mask():
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, -3:] = 0  # a right-padded sequence
    return mask


@pytest.mark.parametrize("name", preset_params(WITH_AUX_LOSS))
def test_hf_aux_loss_trains_under_reentrant_checkpointing(name):
    ids, labels = batch()
    want_out, want = _step(_model(name), ids, labels)
    want64_out, want64 = _step64(_model(name), ids, labels)
    assert want_out.aux_loss.grad_fn is not None
    _, lost = _step(_model(name, reentrant=True), ids, labels)
    # transformers' own checkpointed model loses the loss's gradient: the test can tell.
    assert max((lost[n] - want[n]).abs().max() for n in want) > 1e-4
    _, plain = _step(_model(name, converted=True), ids, labels)
    conv = _model(name, converted=True, reentrant=True)
    got_out, got = _step(conv, ids, labels)
    assert got_out.aux_loss.grad_fn is None  # computed without autograd, trained by moe_fn
    assert_jointly_close_to_ref([got_out.aux_loss], [want_out.aux_loss],
                                [want64_out.aux_loss], [f"{name} aux_loss"])
    for n in want:
        # The converted model's own unchecked gradients (transformers' autograd through the
        # loss), in float64.
        torch.testing.assert_close(got[n], plain[n], msg=f"{name} {n}")
    _check_against_hf(got, want, want64, name)
    for _, b in converted_blocks(conv):
        assert b.moe_layer.exchange.counters["cached_dispatch"] == 1  # the recompute ran


@pytest.mark.parametrize("name,options", [
    ("qwen3_moe", {}), ("mixtral", {}), ("qwen2_moe", dict(skip_recompute_combine=True)),
    ("gpt_oss", dict(recompute_in_checkpoint=False)),
    ("olmoe", dict(skip_recompute_combine=True, impl="reference")),
])
def test_hf_aux_loss_with_padding_and_every_recompute_option(name, options):
    ids, labels = batch()
    mask = _padding_mask()
    _, want = _step(_model(name), ids, labels, mask)
    _, want64 = _step64(_model(name), ids, labels, mask)
    _, plain = _step(_model(name, converted=True, **options), ids, labels, mask)
    conv = _model(name, converted=True, reentrant=True, **options)
    _, got = _step(conv, ids, labels, mask)
    for n in want:
        torch.testing.assert_close(got[n], plain[n], msg=f"{name} {n}")
    _check_against_hf(got, want, want64, name)
    if options.get("skip_recompute_combine"):
        assert all(b.moe_layer.exchange.counters["combine_skipped"] == 1
                   for _, b in converted_blocks(conv))


def test_hf_aux_loss_trains_only_when_transformers_adds_it_to_the_loss():
    """Without labels transformers computes aux_loss but adds it to no loss: nothing is
    injected (the gradients are those of the objective used); a scaled loss takes the
    scale by set_loss_scale."""
    ids, labels = batch()
    _, want = _step(_model("qwen3_moe", converted=True), ids)
    _, got = _step(_model("qwen3_moe", converted=True, reentrant=True), ids)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)
    _, want = _step(_model("qwen3_moe", converted=True), ids, labels, scale=0.25)
    conv = _model("qwen3_moe", converted=True, reentrant=True)
    balance.set_loss_scale(conv, 0.25)
    _, got = _step(conv, ids, labels, scale=0.25)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)


def test_mixed_checkpoint_modes_pool_every_layers_counts():
    """Decoder layer 0 reentrant, layer 1 unchecked: layer 1's logits carry their gradient
    through transformers' loss, layer 0's is injected, both from the model-wide counts."""
    ids, labels = batch()
    _, want = _step(_model("qwen3_moe", converted=True), ids, labels)
    conv = _model("qwen3_moe", converted=True, reentrant=True)
    conv.model.layers[1].gradient_checkpointing = False
    _, got = _step(conv, ids, labels)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)


def test_backward_before_the_forward_returns_is_refused():
    from moe_fn.hf.aux_loss import AuxLossForward, AuxLossTerm

    fwd = AuxLossForward(coef=0.1, num_experts=4, top_k=2, attention_mask=None)
    fwd.add(torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="before the model's forward returned"):
        AuxLossTerm(fwd).grad(torch.randn(3, 4))


# ---- the aux-loss-free bias update of converted models ---------------------------------------


@pytest.mark.parametrize("name", preset_params(["deepseek_v3", "glm4_moe", "dots1",
                                                "ernie4_5_moe", "minimax_m2"]))
def test_bias_update_of_converted_models_matches_hf_routing(name):
    """Each step: the unconverted model routes the batch (its experts' top-k indices are the
    loads), its bias moves by the rule written out here; the converted model's bias (HF's
    own buffer, ERNIE's (1, E) parameter) must move identically."""
    ref = make_model(name)
    conv = convert(copy.deepcopy(ref))
    for m in (ref, conv):
        m.train()
    ref_blocks = [m for n, m in ref.named_modules() if n in dict(converted_blocks(conv))]
    seen = {}
    for b in ref_blocks:
        b.experts.register_forward_pre_hook(
            lambda mod, args, b=b: seen.setdefault(id(b), []).append(args[1].reshape(-1)))
    rate = 0.25
    # One fixed batch routed by the unconverted model after every update: its weights do not
    # move (no optimizer step), so only the bias can change that batch's routes.
    probe = batch(seed=100)[0]

    def probe_routes():
        seen.clear()
        ref.eval()
        with torch.no_grad():
            ref(input_ids=probe, use_cache=False)
        ref.train()
        return torch.cat([torch.cat(seen[id(b)]) for b in ref_blocks])

    routes = [probe_routes()]
    for step in range(3):
        ids, labels = batch(seed=step)
        seen.clear()
        for m in (ref, conv):
            m(input_ids=ids, labels=labels, use_cache=False).loss.backward()
        loads = balance.update_expert_bias(conv, rate)
        for (bname, cb), rb in zip(converted_blocks(conv), ref_blocks):
            e = cb.moe_layer.config.num_experts
            load = torch.bincount(torch.cat(seen[id(rb)]), minlength=e)
            assert torch.equal(loads[bname].last, load), (step, bname)
            ref_bias = _get(rb, cb.moe_preset.bias_attr)
            with torch.no_grad():
                ref_bias.copy_(ref_bias + rate * torch.sign(
                    load.float().mean() - load.float()).reshape(ref_bias.shape))
            assert torch.equal(_get(cb, cb.moe_preset.bias_attr), ref_bias), (step, bname)
        routes.append(probe_routes())
    # The bias moved routes: the same tokens go elsewhere than before the first update.
    assert not torch.equal(routes[0], routes[-1])


def _get(module, path):
    return functools.reduce(getattr, path.split("."), module)


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_in_layer_losses_of_a_converted_model_read_the_blocks_sequences(name):
    """Qwen2-MoE's block flattens its tokens before the routed experts: the layer still
    balances each (batch, sequence) row's tokens as one sequence, and trains the same under
    reentrant checkpointing as without it."""
    from tests.pure.test_balance import naive_sequence, naive_switch

    opts = dict(aux_loss_coef=0.1, seq_aux_loss_coef=0.05, z_loss_coef=0.01)
    ids, labels = batch()
    plain_model = _model(name, converted=True, **opts)
    out, plain = _step(plain_model, ids, labels)
    _, got = _step(_model(name, converted=True, reentrant=True, **opts), ids, labels)
    for n in plain:
        torch.testing.assert_close(got[n], plain[n], msg=f"{name} {n}")
    for (_, b), logits in zip(converted_blocks(plain_model), out.router_logits):
        losses = b.moe_layer.balance_losses
        k = b.moe_layer.config.top_k
        torch.testing.assert_close(losses.sequence, naive_sequence(logits.detach(), k,
                                                                   "softmax", ids.shape[1]))
        torch.testing.assert_close(losses.switch, naive_switch(logits.detach(), k, "softmax"))
