"""Misuse of converted models that HF honours and a converted block cannot: refused by name."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from moe_fn.hf import convert, converted_blocks
from tests.hf.models import (
    Parity,
    available,
    batch,
    float64_twin,
    keep_float64,
    make_model,
    preset_params,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable:FutureWarning")


def _router(model):
    return model.model.layers[0].mlp.gate


def test_router_forward_hook_that_changes_the_output_is_refused():
    ref = make_model("qwen3_moe")
    conv = convert(copy.deepcopy(ref))
    ids, _ = batch()

    def double_logits(module, args, out):
        return (out[0] * 2, *out[1:])

    for m in (ref, conv):
        _router(m).register_forward_hook(double_logits)
    # transformers routes by the hooked output, so the converted block must not run on.
    want = ref(input_ids=ids).logits
    with pytest.raises(RuntimeError, match="forward hook on the router.*double_logits"):
        conv(input_ids=ids)
    assert torch.isfinite(want).all()


def test_router_forward_hook_writing_into_the_output_is_refused():
    conv = convert(make_model("qwen3_moe"))

    def scale_in_place(module, args, out):
        out[0].mul_(2)

    _router(conv).register_forward_hook(scale_in_place)
    with pytest.raises(RuntimeError, match="forward hook on the router"):
        conv(input_ids=batch()[0])


def test_router_forward_pre_hook_that_changes_the_input_is_refused():
    conv = convert(make_model("qwen3_moe"))
    _router(conv).register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
    with pytest.raises(RuntimeError, match="forward pre-hook on the router"):
        conv(input_ids=batch()[0])


@pytest.mark.parametrize("name", preset_params(["qwen3_moe", "mixtral", "deepseek_v3",
                                                  "gpt_oss", "llama4"]))
def test_router_hooks_that_only_read_still_run_and_see_what_hf_routers_see(name):
    ref = make_model(name)
    ref64 = float64_twin(ref)  # the oracle, copied before the hooks are registered
    conv = convert(copy.deepcopy(ref))
    block_name, block = converted_blocks(conv)[0]
    attr = block.moe_preset.router_attr
    routers = {"conv": getattr(block, attr),
               "ref": getattr(ref.get_submodule(block_name), attr)}
    seen = {}

    logits_at = 1 if name == "llama4" else 0  # Llama-4's router returns (scores, logits)

    def reader(tag):
        def pre(module, args):
            seen[tag + "_calls"] = seen.get(tag + "_calls", 0) + 1

        def post(module, args, out):
            seen.setdefault(tag, out[logits_at].detach().clone())
        return pre, post

    for tag, router in routers.items():
        pre, post = reader(tag)
        router.register_forward_pre_hook(pre)
        router.register_forward_hook(post)
    ids, _ = batch()
    got, want = conv(input_ids=ids).logits, ref(input_ids=ids).logits
    with keep_float64():
        want64 = ref64(input_ids=ids).logits
    parity = Parity(name)
    parity.add("logits", got, want, want64)
    parity.check()
    # The first block's router is HF's own module on the same hidden states: the same bits.
    assert torch.equal(seen["conv"], seen["ref"])
    assert seen["conv_calls"] == seen["ref_calls"] == 1


@pytest.mark.skipif(not available("deepseek_v3"), reason="transformers lacks DeepSeek-V3")
def test_converted_nonfinite_score_correction_bias_is_refused_at_load():
    conv = convert(make_model("deepseek_v3"))
    sd = conv.state_dict()
    key = next(k for k in sd if k.endswith("e_score_correction_bias"))
    sd[key] = sd[key].clone()
    sd[key][3] = float("nan")
    with pytest.raises(ValueError, match=r"e_score_correction_bias.*non-finite.*experts \[3\]"):
        conv.load_state_dict(sd)


def _enable_reentrant(model):
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})


def _aux_model():
    model = make_model("qwen3_moe")
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = 0.02
    return model


@pytest.mark.parametrize("where", ["inner model", "some blocks"])
def test_reentrant_checkpointing_warns_where_hf_aux_loss_cannot_train(where):
    """Converting the inner model (whose forward does not compute transformers' loss) or
    leaving MoE blocks unconverted: under reentrant checkpointing that loss trains nothing,
    as in transformers, and enabling it says so, pointing to the in-layer loss."""
    model = _aux_model()
    if where == "inner model":
        convert(model.model)
    else:
        convert(model, moe_layer_pattern=r"model\.layers\.0\.mlp")
    with pytest.warns(UserWarning, match="router_aux_loss_coef=0.02.*does not train.*"
                                         "in-layer loss"):
        _enable_reentrant(model)
    # Its reason holds: the aux loss has no gradient there (as in transformers).
    out = model(input_ids=batch()[0], output_router_logits=True)
    assert out.aux_loss.grad_fn is None


def test_reentrant_checkpointing_enabled_before_a_partial_convert_also_warns():
    model = _aux_model()
    _enable_reentrant(model)
    with pytest.warns(UserWarning, match="does not train the routers"):
        convert(model, moe_layer_pattern=r"model\.layers\.1\.mlp")


def test_a_fully_converted_model_trains_hf_aux_loss_without_a_warning():
    """The converted model computes transformers' loss's gradient itself (tests/hf/
    test_aux_loss.py checks its value): enabling reentrant checkpointing is quiet."""
    model = convert(_aux_model())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*does not train the routers")
        _enable_reentrant(model)


@pytest.mark.parametrize("reentrant", [False, True])
def test_no_aux_warning_without_the_loss_or_under_non_reentrant(reentrant):
    model = make_model("qwen3_moe")
    model.config.output_router_logits = not reentrant
    model.config.router_aux_loss_coef = 0.02
    conv = convert(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*does not train the routers")
        conv.train()
        conv.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
