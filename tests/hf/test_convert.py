"""convert() against the unconverted Hugging Face model, one process, float32."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import transformers

from moe_fn.hf import ConvertedBlock, convert, converted_blocks, gather_expert_state_dict
from tests.hf.models import (
    SUPPORTED,
    Parity,
    available,
    batch,
    float64_twin,
    keep_float64,
    make_model,
    preset_params,
    run,
    run64,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable:FutureWarning")


def _pair(name, ckpt=False, **options):
    """The unconverted model, unchecked (its gradients are what a checkpoint must
    reproduce: transformers' own reentrant checkpointing loses its load-balancing loss's),
    and a converted copy, under HF's reentrant checkpointing with ``ckpt``."""
    ref = make_model(name)
    conv = convert(copy.deepcopy(ref), **options)
    for m in (ref, conv):
        m.train()
    if ckpt:
        conv.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return ref, conv


def _add_grads(parity, conv, ref, ref64, name, leave_out=()):
    want = dict(ref.named_parameters())
    want64 = dict(ref64.named_parameters())
    got = dict(conv.named_parameters())
    assert got.keys() == want.keys() == want64.keys()
    for pname, p in got.items():
        w = want[pname].grad
        if w is None:
            assert p.grad is None or not p.grad.any(), f"{name}: {pname} has a gradient HF lacks"
            continue
        assert p.grad is not None, f"{name}: {pname} got no gradient"
        if pname in leave_out:
            continue
        parity.add(f"grad {pname}", p.grad, w, want64[pname].grad)


def _assert_matches_hf(conv, ref, name, seed=None, leave_out=()):
    """One step (forward with labels and router logits, backward) of the converted model
    and of HF's, against HF's float64 twin: outputs and every gradient by the tolerance
    rule, with HF's float32 model as plain PyTorch. ``seed`` before each run (jitter);
    ``leave_out``: parameters whose gradients are not compared (rounding noise in float32,
    where the rule cannot fail)."""
    ref64 = float64_twin(ref)
    ids, labels = batch()
    outs = []
    for model, step in ((ref, run), (conv, run), (ref64, run64)):
        if seed is not None:
            torch.manual_seed(seed)
        outs.append(step(model, ids, labels))
    want, got, want64 = outs
    parity = Parity(name)
    parity.add_outputs(got, want, want64)
    _add_grads(parity, conv, ref, ref64, name, leave_out)
    parity.check()


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("name", preset_params(SUPPORTED))
def test_matches_hf(name, ckpt):
    _check_matches_hf(name, ckpt)


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3", "minimax_m3", "gpt_oss"])
def test_checkpointed_skip_recompute_combine(name):
    blocks = _check_matches_hf(name, True, skip_recompute_combine=True)
    assert all(b.moe_layer.exchange.counters["combine_skipped"] == 1 for _, b in blocks)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_checkpointed_without_recomputing_the_moe(name):
    """recompute_in_checkpoint=False under HF's reentrant checkpointing: HF's outputs and
    gradients (router logits and the auxiliary loss included), with the MoE layer run once."""
    ref, conv = _pair(name, True, recompute_in_checkpoint=False)
    _assert_matches_hf(conv, ref, name)
    for _, b in converted_blocks(conv):
        c = b.moe_layer.exchange.counters
        assert (c["layout"], c["dispatch"], c["cached_dispatch"], c["combine"]) == (1, 1, 0, 1)
        assert c["dispatch_backward"] == 1


def _check_matches_hf(name, ckpt, **options):
    ref, conv = _pair(name, ckpt, **options)
    blocks = converted_blocks(conv)
    assert blocks and all(b.moe_layer.config.ep_size == 1 for _, b in blocks)
    _assert_matches_hf(conv, ref, name)
    # The experts' weights received gradients, so the MoELayer ran on HF's parameters; HF's
    # reentrant recompute replayed the route (one layout, one cached dispatch).
    for _, b in blocks:
        assert b.experts.gate_up_proj.grad is not None and b.experts.gate_up_proj.grad.any()
        counters = b.moe_layer.exchange.counters
        assert (counters["layout"], counters["cached_dispatch"]) == (1, int(ckpt))
    return blocks


def _same_param(view, param):
    """``view`` is ``param`` itself or a view of it (GPT-OSS's transposed experts)."""
    return view is param or (view._base is param and view.data_ptr() == param.data_ptr())


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3", "minimax_m3", "gpt_oss"])
def test_state_dict_round_trip_and_sharing(name):
    ref = make_model(name)
    conv = convert(make_model(name, seed=1))
    sd = conv.state_dict()
    want = ref.state_dict()
    assert list(sd) == list(want)
    assert all(sd[k].shape == want[k].shape for k in sd)
    # HF -> converted: the MoELayer computes with the loaded weights (shared, not copied).
    conv.load_state_dict(want, strict=True)
    for _, b in converted_blocks(conv):
        layer, router = b.moe_layer, getattr(b, b.moe_preset.router_attr)
        assert _same_param(layer.experts.gate_up_proj, b.experts.gate_up_proj)
        assert _same_param(layer.experts.down_proj, b.experts.down_proj)
        assert layer.router.weight is router.weight
        if layer.config.expert_bias:
            assert layer.router.bias is router.bias
            assert layer.experts.gate_up_proj_bias is b.experts.gate_up_proj_bias
            assert layer.experts.down_proj_bias is b.experts.down_proj_bias
    ids, labels = batch()
    ref64 = float64_twin(ref)
    with torch.no_grad():
        parity = Parity(name)
        with keep_float64():
            want64 = ref64(input_ids=ids).logits
        parity.add("logits", conv(input_ids=ids).logits, ref(input_ids=ids).logits, want64)
        parity.check()
    # converted -> HF (gather is the identity without expert parallelism): HF's model on
    # the same weights, the same bits.
    fresh = make_model(name, seed=2)
    fresh.load_state_dict(gather_expert_state_dict(conv), strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, ref(input_ids=ids).logits)


@pytest.mark.parametrize("name", ["deepseek_v3", "minimax_m2", "gpt_oss"])
def test_bfloat16_with_float32_router(name):
    """.to() reaches the shared parameters; a float32 router in a bf16 model (HF keeps
    DeepSeek's gate.weight in float32) routes as HF does."""
    ref = make_model(name).bfloat16()
    conv = convert(make_model(name)).bfloat16()
    conv.load_state_dict(ref.state_dict())
    for m in (ref, conv):
        for n, p in m.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.data = p.data.float()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    for (_, b), w in zip(converted_blocks(conv), _blocks_like(ref, conv)):
        w64 = copy.deepcopy(w).double()
        w64.experts.config._experts_implementation = "eager"  # grouped_mm has no float64
        with torch.no_grad():
            got, want, exact = (_hidden(m(a)) for m, a in ((b, x.clone()), (w, x.clone()),
                                                            (w64, x.double())))
        assert got.dtype == torch.bfloat16
        # At most twice HF's own bf16 error against float64, plus one bf16 step.
        err, hf_err = (got.double() - exact).abs().max(), (want.double() - exact).abs().max()
        assert err <= 2 * hf_err + 2**-8 * exact.abs().max(), (float(err), float(hf_err))


@pytest.mark.parametrize("name", preset_params(SUPPORTED))
def test_autocast_block_within_bfloat16_rounding(name):
    """Under torch.autocast (bf16) a converted block runs forward and backward, and its
    output and every gradient (input, its parameters: float32, as they are) lie within a
    few bf16 steps of the float64 block's; a wrong path or a parameter's gradient lost in
    a cast would be off by the size of the values, 256 steps."""
    conv, ref = convert(make_model(name)), make_model(name)
    (block_name, block), *_ = converted_blocks(conv)
    exact = copy.deepcopy(dict(ref.named_modules())[block_name]).double()
    if hasattr(exact.experts, "config"):  # Step-3.7's experts have one implementation
        exact.experts.config._experts_implementation = "eager"  # grouped_mm has no float64
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(2, 8, 16, generator=gen), torch.randn(2, 8, 16, generator=gen)
    results = []
    for m, a, cast in ((block, x.clone(), True), (exact, x.double(), False)):
        m.train()
        a.requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
            out = _hidden(m(a)).view(a.shape)  # Llama-4's block returns (T, H)
        (out.double() * g.double()).sum().backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        results.append((out, a.grad, grads))
    (out, dx, grads), (want, want_dx, want_grads) = results
    assert out.dtype == torch.bfloat16 and grads.keys() == want_grads.keys()
    assert all(p.grad is None or p.grad.dtype == p.dtype == torch.float32
               for p in block.parameters())
    # Not the twice-plain rule: HF's own block under autocast keeps parts in float32 (its
    # output too, for most presets), so it is no same-precision plain. The bound is in bf16
    # steps of each result's magnitude, far above any float32 summation order's effect.
    for what, got, w in [("out", out, want), ("x grad", dx, want_dx),
                         *((f"{n} grad", grads[n], want_grads[n]) for n in want_grads)]:
        err = (got.double() - w).abs().max()
        assert err <= 8 * 2**-8 * w.abs().max(), (name, what, float(err), float(w.abs().max()))


def _hidden(out):
    # GPT-OSS: (hidden, router_scores); Llama-4: (hidden, router_logits).
    return out[0] if isinstance(out, tuple) else out


def _blocks_like(ref, conv):
    mods = dict(ref.named_modules())
    return [mods[n] for n, _ in converted_blocks(conv)]


@pytest.mark.parametrize("options", [
    dict(gate_up_impl="separate"),
    dict(score_apply="activation"),
    dict(impl="reference"),
])
def test_options_keep_parity(options):
    ref, conv = _pair("qwen3_moe", **options)
    assert all(getattr(b.moe_layer.config, k) == v
               for _, b in converted_blocks(conv) for k, v in options.items())
    _assert_matches_hf(conv, ref, str(options))


def test_mixtral_jitter_in_training():
    ref, conv = _pair("mixtral")
    for m in (ref, conv):
        for mod in m.modules():
            if hasattr(mod, "jitter_noise"):
                mod.jitter_noise = 0.1
    _assert_matches_hf(conv, ref, "mixtral jitter", seed=5)


def test_hooks_installed_before_convert_still_record():
    model = make_model("qwen3_moe")
    ids, labels = batch()
    want = model(input_ids=ids, output_router_logits=True)  # installs HF's capture hooks
    model64 = float64_twin(model)
    with keep_float64():
        want64 = model64(input_ids=ids, output_router_logits=True)
    convert(model)
    got = model(input_ids=ids, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits) == 2
    parity = Parity("qwen3_moe")
    for i, (g, w, w64) in enumerate(zip(got.router_logits, want.router_logits,
                                        want64.router_logits)):
        parity.add(f"router logits[{i}]", g, w, w64)
    parity.check()


def test_router_called_directly_is_hf():
    ref = make_model("qwen3_moe")
    conv = convert(copy.deepcopy(ref))
    x = torch.randn(5, 16)
    for g, w in zip(conv.model.layers[0].mlp.gate(x), ref.model.layers[0].mlp.gate(x)):
        assert torch.equal(g, w)  # HF's own router module on the same input
    blk = conv.model.layers[0].mlp
    assert isinstance(blk, type(ref.model.layers[0].mlp)) and isinstance(blk, ConvertedBlock)


def test_pattern_selects_blocks():
    ref = make_model("olmoe")
    conv = convert(copy.deepcopy(ref), moe_layer_pattern=r"model\.layers\.1\.mlp")
    assert [n for n, _ in converted_blocks(conv)] == ["model.layers.1.mlp"]
    _assert_matches_hf(conv, ref, "olmoe pattern")


def test_unsupported_model_type():
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="no moe_fn preset.*Supported: .*qwen3_moe"):
        convert(transformers.LlamaForCausalLM(cfg))
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        convert(make_model("olmoe"), preset="nope")
    with pytest.raises(ValueError, match="no MixtralSparseMoeBlock"):
        convert(make_model("olmoe"), preset="mixtral")


def test_gpt_oss_block_returns_router_scores_and_needs_post():
    ref = make_model("gpt_oss")
    conv = convert(copy.deepcopy(ref))
    cfg = conv.model.layers[0].mlp.moe_layer.config
    assert (cfg.router_bias, cfg.expert_bias, cfg.gate_up_layout, cfg.score_func) == (
        True, True, "interleaved", "softmax_topk")
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(4))
    block64 = float64_twin(ref.model.layers[0].mlp)
    with torch.no_grad():
        (got, got_scores), (want, want_scores) = conv.model.layers[0].mlp(x), \
            ref.model.layers[0].mlp(x)
        with keep_float64():
            want64, want64_scores = block64(x.double())
    parity = Parity("gpt_oss")
    parity.add("mlp", got, want, want64)
    parity.add("router scores", got_scores, want_scores, want64_scores)
    parity.check()
    # The routing weight scales the down bias too: only score_apply="post" computes that.
    with pytest.raises(ValueError, match="expert_bias needs score_apply='post'"):
        convert(make_model("gpt_oss"), score_apply="activation")


def test_bad_patterns_and_options():
    m = make_model("olmoe")
    with pytest.raises(ValueError, match="matches no OlmoeSparseMoeBlock"):
        convert(m, moe_layer_pattern=r"model\.layers\.\d+\.self_attn")
    with pytest.raises(ValueError, match="skip_recompute_combine=True cannot be combined"):
        convert(m, moe_layer_pattern=r"model\.layers\.\d+\.mlp", skip_recompute_combine=True)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['gate_up'\]"):
        convert(m, gate_up="fused")
    with pytest.raises(ValueError, match=r"\['top_k'\] are set by the preset"):
        convert(m, top_k=1)
    with pytest.raises(ValueError, match="score_apply='pre' weights the experts' inputs"):
        convert(m, score_apply="pre")
    with pytest.raises(ValueError, match="ep_size must be a positive int"):
        convert(m, ep_size=0)
    with pytest.raises(ValueError, match="not a valid regular expression"):
        convert(m, moe_layer_pattern="((")
    with pytest.raises(TypeError, match="model must be a transformers model"):
        convert(None)
    assert not converted_blocks(m)  # nothing half-converted by a refused call
    convert(m, skip_recompute_combine=True)  # a preset's own blocks may skip
    with pytest.raises(ValueError, match="already converted"):
        convert(m)


# Without use_reentrant torch runs a reentrant checkpoint (and warns): replay follows it.
@pytest.mark.filterwarnings("ignore:torch.utils.checkpoint")
@pytest.mark.parametrize("kwargs", [{"use_reentrant": True}, {"use_reentrant": False}, {}])
def test_checkpointing_enabled_before_convert(kwargs):
    ref = make_model("olmoe")
    conv = copy.deepcopy(ref)
    for m in (ref, conv):
        m.train()
    conv.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    convert(conv)
    _assert_matches_hf(conv, ref, "olmoe")
    for _, b in converted_blocks(conv):
        counters = b.moe_layer.exchange.counters
        assert (counters["layout"], counters["cached_dispatch"]) == (1, 1)


def test_expert_parameter_names_cover_every_expert_parameter():
    from moe_fn.hf import expert_parameter_names

    _, conv = _pair("gpt_oss")
    names = expert_parameter_names(conv)
    params = dict(conv.named_parameters())
    assert names <= params.keys()
    want = {n for n in params if ".experts." in n}  # GPT-OSS's biases included
    assert names == want and any(n.endswith("_bias") for n in names)


def test_unreadable_checkpoint_function_is_refused_where_options_need_replay():
    def custom_checkpoint(fn, *args, **kwargs):  # a framework's own: mode unknown
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True, **kwargs)

    _, conv = _pair("olmoe", skip_recompute_combine=True)
    decoder = conv.model.layers[0]
    decoder._gradient_checkpointing_func = custom_checkpoint  # HF sets it before the flag
    with pytest.raises(ValueError, match="skip_recompute_combine=True would be ignored"):
        decoder.gradient_checkpointing = True
    # Assigned while checkpointing is on: refused at its first use, before the step runs.
    _, on = _pair("olmoe", ckpt=True, skip_recompute_combine=True)
    on.model.layers[0]._gradient_checkpointing_func = custom_checkpoint
    for _ in range(2):  # refused at every use: a caught refusal lets no later step through
        with pytest.raises(ValueError, match="skip_recompute_combine=True would be ignored"):
            run(on, *batch())
    # A refused enable leaves the flag off: the layer runs unchecked, not silently without
    # the replay its options need.
    assert not decoder.gradient_checkpointing
    _, plain = _pair("olmoe")
    plain.model.layers[0]._gradient_checkpointing_func = custom_checkpoint
    with pytest.warns(UserWarning, match="cannot tell whether the checkpoint function"):
        plain.model.layers[0].gradient_checkpointing = True


@pytest.mark.parametrize("option", [{}, {"skip_recompute_combine": True},
                                    {"recompute_in_checkpoint": False}])
@pytest.mark.parametrize("disable", ["gradient_checkpointing_disable",
                                     "activation_checkpointing_disable"])
def test_checkpointing_can_be_disabled_quietly(option, disable):
    """HF's disable assigns its bare default checkpoint function (whose mode cannot be read)
    while the flag is still on: that is neither refused (with the skip) nor warned about
    per layer. Disabled, the layers run unchecked: one forward each, no replay."""
    import warnings

    if not hasattr(transformers.PreTrainedModel, disable):
        pytest.skip(f"this transformers has no {disable}")
    _, conv = _pair("olmoe", ckpt=True, **option)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        getattr(conv, disable)()
    assert not any(layer.gradient_checkpointing for layer in conv.model.layers)
    run(conv, *batch())
    for _, b in converted_blocks(conv):
        counters = b.moe_layer.exchange.counters
        assert (counters["layout"], counters["cached_dispatch"], counters["combine"]) == (1, 0, 1)
    conv.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert all(layer.gradient_checkpointing for layer in conv.model.layers)


def test_a_subclass_of_a_converted_class_copies_as_itself():
    """FSDP2 (and users) subclass the classes made at conversion: copies keep the subclass
    (not the made class rebuilt from the subclass's bases, nor a failure)."""
    _, conv = _pair("olmoe")
    layer = conv.model.layers[0]
    sub = type("Sub", (type(layer),), {})
    layer.__class__ = sub
    assert type(copy.deepcopy(layer)) is sub
    assert type(copy.deepcopy(conv.model.layers[1])) is type(conv.model.layers[1])


def test_converted_model_pickles_and_loads_in_a_fresh_process(tmp_path):
    """The converted classes are made at conversion; a pickled model loads where they were
    never made (a new interpreter) and computes what it did."""
    import functools
    import subprocess
    import sys

    _, conv = _pair("qwen3_moe", skip_recompute_combine=True)
    # Checkpointing on as HF's enable sets it per layer (the enable itself also adds an input
    # hook of transformers' that is a local function, which no pickle takes).
    for layer in conv.model.layers:
        layer._gradient_checkpointing_func = functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=True)
        layer.gradient_checkpointing = True
    ids, _ = batch()
    # Saved before any forward: transformers' output-capturing hooks (local functions, not
    # moe_fn's) make a model that has run unpicklable. Compared by logits without router
    # outputs, which transformers 5.24 no longer captures after a pickle round trip of its
    # own unconverted models either.
    torch.save(conv, tmp_path / "m.pt")
    torch.save((ids, conv(input_ids=ids, use_cache=False).logits.detach()), tmp_path / "io.pt")
    code = (
        "import torch\n"
        f"m = torch.load({str(tmp_path / 'm.pt')!r}, weights_only=False)\n"
        f"ids, want = torch.load({str(tmp_path / 'io.pt')!r})\n"
        "layer = m.model.layers[0]\n"
        "assert type(layer).__name__.startswith('MoeFn'), type(layer)\n"
        "assert layer.gradient_checkpointing and layer._gradient_checkpointing_func.moe_fn_replay\n"
        "got = m(input_ids=ids, use_cache=False).logits\n"
        "assert torch.equal(got, want), (got - want).abs().max()\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("option", [{"skip_recompute_combine": True},
                                    {"recompute_in_checkpoint": False}])
def test_unreadable_checkpoint_function_is_refused_before_anything_is_converted(option):
    """Checkpointing already enabled with a function whose mode cannot be read: convert
    refuses the replay-only options before it changes any block, so the model still
    trains as it was (not with its first block converted before the refusal, left without
    its checkpoint function)."""
    model = make_model("qwen3_moe")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": 1})
    with pytest.raises(ValueError, match="would be ignored"):
        convert(model, **option)
    assert converted_blocks(model) == []
    assert all(layer._gradient_checkpointing_func is not None for layer in model.model.layers)
    model.train()
    run(model, *batch())


def test_convert_argument_types():
    model = make_model("qwen3_moe")
    with pytest.raises(TypeError, match="moe_layer_pattern must be a str or None, got int"):
        convert(model, moe_layer_pattern=3)
    with pytest.raises(TypeError, match="preset must be a str or None, got list"):
        convert(model, preset=["qwen3_moe"])
    assert converted_blocks(model) == []
    with pytest.raises(TypeError, match="model must be an nn.Module, got int"):
        gather_expert_state_dict(3)


def test_skip_under_a_non_reentrant_hf_checkpoint_warns():
    """The skip applies to reentrant recomputes only: said when HF's checkpoint function is
    non-reentrant (transformers picks that mode when no kwargs are given), not left silent."""
    _, conv = _pair("olmoe", skip_recompute_combine=True)
    with pytest.warns(UserWarning, match="skip_recompute_combine=True does not apply"):
        conv.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="skip_recompute_combine", category=UserWarning)
        conv.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})


@pytest.mark.parametrize("name", preset_params(["step3p7"]))
def test_step3p7_clamped_block_is_refused_and_the_others_convert(name):
    """Step-3.7 clamps after the SiLU on layers with a swiglu_limits entry, which no moe_fn
    activation computes: such a block is refused before any block is converted, and the
    other blocks convert (moe_layer_pattern) and match HF, the clamped layer run by HF."""
    ref = make_model(name)
    ref.model.language_model.layers[1].mlp.experts.limit = 0.05  # reached by the tiny model
    with pytest.raises(ValueError, match=r"layers\.1\.mlp cannot be converted: .*clamp after"):
        convert(copy.deepcopy(ref))
    conv = convert(copy.deepcopy(ref), moe_layer_pattern=r"model\.language_model\.layers\.0\.mlp")
    assert [n for n, _ in converted_blocks(conv)] == ["model.language_model.layers.0.mlp"]
    ref.train()
    conv.train()
    _assert_matches_hf(conv, ref, name)


@pytest.mark.parametrize("name", preset_params(["ernie4_5_moe"]))
def test_ernie_bias_is_read_in_place_and_a_large_norm_floor_refused(name):
    """ERNIE-4.5's score-correction bias, a frozen (1, E) parameter, is what the MoELayer
    reads (an (E,) view of it); a moe_norm_min above 1e-12 would floor the top-k sum where
    moe_fn adds 1e-20, so it is refused."""
    conv = convert(make_model(name))
    for _, b in converted_blocks(conv):
        bias = b.gate.moe_statics.e_score_correction_bias
        view = b.moe_layer.router.e_score_correction_bias
        assert view.shape == bias.shape[1:] and view.data_ptr() == bias.data_ptr()
    model = make_model(name)
    model.config.moe_norm_min = 1e-6
    with pytest.raises(ValueError, match="moe_norm_min=1e-06 > 1e-12"):
        convert(model)
    assert converted_blocks(model) == []


def test_gpt_oss_swiglu_constants_default_as_older_transformers_fix_them():
    """transformers 5.17 and older hardcode GPT-OSS's alpha 1.702 and limit 7.0 in its
    experts (no config fields); newer ones read swiglu_alpha/swiglu_limit from the config."""
    import types

    from moe_fn.hf.presets import PRESETS

    routing = PRESETS["gpt_oss"].routing
    old = routing(types.SimpleNamespace())
    assert (old["activation_alpha"], old["activation_limit"]) == (1.702, 7.0)
    new = routing(types.SimpleNamespace(swiglu_alpha=1.5, swiglu_limit=5.0))
    assert (new["activation_alpha"], new["activation_limit"]) == (1.5, 5.0)


def test_gelu_new_and_gelu_fast_experts_convert_as_the_tanh_gelu():
    """HF's gelu_new and gelu_fast are the tanh approximation under other names: converted
    experts with them match HF."""
    from tests.hf.models import _COMMON

    for act in ("gelu_new", "gelu_fast"):
        cfg = transformers.Qwen3MoeConfig(**_COMMON, head_dim=8, intermediate_size=24,
                                          moe_intermediate_size=8, num_experts=8,
                                          num_experts_per_tok=2, hidden_act=act)
        torch.manual_seed(0)
        ref = transformers.Qwen3MoeForCausalLM(cfg).train()
        with torch.no_grad():
            for n, p in ref.named_parameters():
                if "experts" in n:
                    p.normal_(0, 0.3)
        conv = convert(copy.deepcopy(ref))
        assert all(b.moe_layer.config.activation == "geglu_tanh"
                   for _, b in converted_blocks(conv))
        _assert_matches_hf(conv, ref, act)


def test_a_block_the_layer_cannot_run_is_refused_by_name_before_any_converts():
    """A config that makes a layer moe_fn cannot run (here one router asks for more experts
    than there are; DeepSeek-V2's grouped choice without its groups) is refused, naming
    the preset and block, and no block is converted."""
    model = make_model("qwen3_moe")
    model.model.layers[1].mlp.gate.top_k = 99
    with pytest.raises(ValueError, match=r"qwen3_moe: model\.layers\.1\.mlp cannot be "
                                         r"converted: .*top_k"):
        convert(model)
    assert converted_blocks(model) == []
    model = make_model("deepseek_v2")
    model.config.n_group = None
    with pytest.raises(ValueError, match="group_limited_greedy' needs positive integer "
                                         r"n_group and topk_group in the config, got \(None, 2\)"):
        convert(model)
    assert converted_blocks(model) == []


@pytest.mark.parametrize("name", preset_params(["llama4", "llama4_top2"]))
def test_llama4_maps_to_pre_weighted_sigmoid_and_converts_its_moe_layers_only(name):
    """Llama-4's block: sigmoid of the chosen logits, unnormalised, weighting the experts'
    inputs (score_apply="pre"), experts transposed as halves; only the decoder layers in
    config.moe_layers hold one (the top-2 model interleaves a dense layer 0). The block
    returns (out (T, H), router_logits) as HF's does."""
    ref = make_model(name)
    conv = convert(copy.deepcopy(ref))
    blocks = converted_blocks(conv)
    assert [n for n, _ in blocks] == [f"model.layers.{i}.feed_forward"
                                      for i in ref.config.moe_layers]
    assert ref.config.moe_layers == ([0, 1] if name == "llama4" else [1])
    for _, b in blocks:
        c = b.moe_layer.config
        assert (c.score_func, c.norm_topk_prob, c.score_apply, c.gate_up_layout, c.activation,
                c.top_k) == ("sigmoid", False, "pre", "halves", "swiglu",
                             ref.config.num_experts_per_tok)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(4))
    layer = ref.config.moe_layers[0]
    block64 = float64_twin(ref.model.layers[layer].feed_forward)
    with torch.no_grad():
        (got, got_logits), (want, want_logits) = (
            m.model.layers[layer].feed_forward(x) for m in (conv, ref))
        with keep_float64():
            want64, want64_logits = block64(x.double())
    assert got.shape == want.shape == (16, 16)
    parity = Parity(name)
    parity.add("block", got, want, want64)
    parity.add("router logits", got_logits, want_logits, want64_logits)
    parity.check()


@pytest.mark.parametrize("name", preset_params(["llama4", "llama4_top2"]))
def test_llama4_chooses_on_the_logits_where_float32_sigmoids_tie(name):
    """HF takes the top-k of the logits, then the sigmoid of the chosen ones: logits above
    ~17 all have the float32 sigmoid 1.0, so a choice on the scores would take the lower
    index where HF takes the larger logit. The converted block chooses as HF does, forward
    and backward, and under HF's checkpointing (whose recompute replays the choice)."""
    ref = make_model(name)
    layer = ref.config.moe_layers[0]
    block = ref.model.layers[layer].feed_forward
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        # Every token's logits 17.5 + 0.5 * j for a random permutation j of the experts.
        e, h = block.router.weight.shape
        flat = x.reshape(-1, h)
        perm = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(i))
                            for i in range(flat.shape[0])]).float()
        target = 17.5 + 0.5 * perm
        block.router.weight.copy_(torch.linalg.lstsq(flat, target).solution.T)
        logits = block.router(flat)[1]
    assert torch.all(torch.sigmoid(logits) == 1.0)  # every score ties in float32
    assert not torch.equal(logits.argmax(-1), torch.zeros_like(logits.argmax(-1)))
    conv = convert(copy.deepcopy(ref))
    twin = float64_twin(ref)
    outs = []
    for m, a in ((conv, x), (ref, x), (twin, x.double())):
        a = a.clone().requires_grad_()
        with keep_float64() if m is twin else contextlib.nullcontext():
            out, _ = m.model.layers[layer].feed_forward(a)
            out.square().sum().backward()
        outs.append((out, a.grad, m.model.layers[layer].feed_forward.experts.down_proj.grad))
    parity = Parity(name)
    for what, got, want, want64 in zip(("out", "x grad", "down_proj grad"), *outs):
        parity.add(what, got, want, want64)
    parity.check()
    # The same in the whole model, under HF's reentrant checkpointing (the replay).
    ref.train()
    conv.train()
    for m in (ref, conv):
        m.zero_grad()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    # That router's gradient passes through sigmoids saturated at 1.0 in float32: rounding
    # noise (about 1e-10) in HF's model as in the converted one, which no rule can bound.
    _assert_matches_hf(conv, ref, name,
                       leave_out={f"model.layers.{layer}.feed_forward.router.weight"})


@pytest.mark.parametrize("value", ["pre", "post", "activation"])
def test_llama4_score_apply_is_derived_and_refused_as_an_option(value):
    """Llama-4 weights the experts' inputs, so its preset sets score_apply="pre" itself: a
    user's score_apply (any value) is refused, naming why; other presets still refuse
    "pre" (their HF weights the outputs)."""
    if not available("llama4"):
        pytest.skip("llama4 needs a newer transformers")
    model = make_model("llama4")
    with pytest.raises(ValueError, match=r"llama4: \['score_apply'\] set by the preset, not "
                                         r"an option: HF's Llama-4 weights each expert's input"):
        convert(model, score_apply=value)
    assert converted_blocks(model) == []
    with pytest.raises(ValueError, match="score_apply='pre' weights the experts' inputs"):
        convert(make_model("qwen3_moe"), score_apply="pre")
