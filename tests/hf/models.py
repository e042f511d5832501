"""Tiny random Hugging Face MoE models, one per preset, and the parity checks the tests share."""

from __future__ import annotations

import copy

import torch
import transformers
from torch.overrides import TorchFunctionMode

from moe_fn.hf import PRESETS
from moe_fn.testing import assert_jointly_close_to_ref

VOCAB = 64
SEQ = 8
BATCH = 2

_COMMON = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False,
               output_router_logits=True, router_aux_loss_coef=0.01)


def _qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(**_COMMON, head_dim=8, intermediate_size=24,
                                      moe_intermediate_size=8, num_experts=8,
                                      num_experts_per_tok=2, norm_topk_prob=False)
    return transformers.Qwen3MoeForCausalLM(cfg)


def _qwen2_moe():
    cfg = transformers.Qwen2MoeConfig(**_COMMON, intermediate_size=24, moe_intermediate_size=8,
                                      shared_expert_intermediate_size=12, num_experts=8,
                                      num_experts_per_tok=2, norm_topk_prob=True)
    return transformers.Qwen2MoeForCausalLM(cfg)


def _qwen3_5_moe():
    from transformers.models.qwen3_5_moe import configuration_qwen3_5_moe as c
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    cfg = c.Qwen3_5MoeTextConfig(**_COMMON, head_dim=8, moe_intermediate_size=8,
                                 shared_expert_intermediate_size=12, num_experts=8,
                                 num_experts_per_tok=2,
                                 layer_types=["linear_attention", "full_attention"],
                                 linear_num_key_heads=2, linear_num_value_heads=2,
                                 linear_key_head_dim=8, linear_value_head_dim=8,
                                 linear_conv_kernel_dim=2)
    return m.Qwen3_5MoeForCausalLM(cfg)


def _mixtral():
    cfg = transformers.MixtralConfig(**_COMMON, head_dim=8, intermediate_size=8,
                                     num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg)


def _olmoe():
    cfg = transformers.OlmoeConfig(**_COMMON, intermediate_size=8, num_experts=8,
                                   num_experts_per_tok=2, norm_topk_prob=True)
    return transformers.OlmoeForCausalLM(cfg)


_MLA = dict(num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, moe_intermediate_size=8, n_shared_experts=1,
            intermediate_size=24)


def _deepseek_v2():
    cfg = transformers.DeepseekV2Config(**(_COMMON | _MLA), n_routed_experts=8,
                                        num_experts_per_tok=3, first_k_dense_replace=1,
                                        topk_method="group_limited_greedy", n_group=4,
                                        topk_group=2, routed_scaling_factor=1.5)
    return transformers.DeepseekV2ForCausalLM(cfg)


def _deepseek_v3():
    cfg = transformers.DeepseekV3Config(**(_COMMON | _MLA), n_routed_experts=8,
                                        num_experts_per_tok=3, first_k_dense_replace=0,
                                        n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                        norm_topk_prob=True)
    return transformers.DeepseekV3ForCausalLM(cfg)


def _glm4_moe():
    cfg = transformers.Glm4MoeConfig(**_COMMON, head_dim=8, intermediate_size=24,
                                     moe_intermediate_size=8, n_routed_experts=8,
                                     n_shared_experts=1, num_experts_per_tok=2,
                                     first_k_dense_replace=0, n_group=2, topk_group=1,
                                     routed_scaling_factor=1.7, norm_topk_prob=False)
    return transformers.Glm4MoeForCausalLM(cfg)


def _minimax_m2():
    cfg = transformers.MiniMaxM2Config(**_COMMON, head_dim=8, intermediate_size=8,
                                       num_local_experts=8, num_experts_per_tok=2)
    return transformers.MiniMaxM2ForCausalLM(cfg)


def _minimax_m3():
    from transformers.models.minimax_m3_vl import configuration_minimax_m3_vl as c
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m

    cfg = c.MiniMaxM3VLTextConfig(**_COMMON, head_dim=8, intermediate_size=8,
                                  shared_intermediate_size=12, dense_intermediate_size=24,
                                  num_local_experts=8, num_experts_per_tok=2,
                                  routed_scaling_factor=2.0, swiglu_limit=0.05,
                                  mlp_layer_types=["dense", "sparse"])
    return m.MiniMaxM3VLForCausalLM(cfg)


def _gpt_oss():
    cfg = transformers.GptOssConfig(**_COMMON, head_dim=8, intermediate_size=8,
                                    num_local_experts=4, num_experts_per_tok=2)
    return transformers.GptOssForCausalLM(cfg)


def _qwen3_next():
    cfg = transformers.Qwen3NextConfig(**_COMMON, head_dim=8, intermediate_size=24,
                                       moe_intermediate_size=8,
                                       shared_expert_intermediate_size=12, num_experts=8,
                                       num_experts_per_tok=2, norm_topk_prob=False,
                                       layer_types=["linear_attention", "full_attention"],
                                       linear_num_key_heads=2, linear_num_value_heads=2,
                                       linear_key_head_dim=8, linear_value_head_dim=8,
                                       linear_conv_kernel_dim=2)
    return transformers.Qwen3NextForCausalLM(cfg)


def _qwen3_vl_moe():
    # The text model's MoE blocks; a tiny vision tower (no MoE) the text-only batch skips.
    from transformers.models.qwen3_vl_moe import configuration_qwen3_vl_moe as c
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as m

    text = {k: v for k, v in _COMMON.items() if k not in ("tie_word_embeddings",
                                                         "output_router_logits")}
    text |= dict(head_dim=8, intermediate_size=24, moe_intermediate_size=8, num_experts=8,
                 num_experts_per_tok=2,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                  "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=2,
                  temporal_patch_size=1, spatial_merge_size=1, out_hidden_size=16,
                  num_position_embeddings=16, deepstack_visual_indexes=[0])
    cfg = c.Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                             image_token_id=VOCAB - 1, video_token_id=VOCAB - 2,
                             vision_start_token_id=VOCAB - 3, vision_end_token_id=VOCAB - 4)
    return m.Qwen3VLMoeForConditionalGeneration(cfg)


def _deepseek_v32():
    from transformers.models.deepseek_v32 import configuration_deepseek_v32 as c
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

    cfg = c.DeepseekV32Config(**(_COMMON | _MLA | dict(q_lora_rank=8)), n_routed_experts=8,
                              num_experts_per_tok=2, first_k_dense_replace=1,
                              mlp_layer_types=["dense", "sparse"], n_group=2, topk_group=1,
                              routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=4,
                              index_head_dim=8, index_n_heads=2, head_dim=4)
    return m.DeepseekV32ForCausalLM(cfg)


def _glm4_moe_lite():
    from transformers.models.glm4_moe_lite import configuration_glm4_moe_lite as c
    from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as m

    cfg = c.Glm4MoeLiteConfig(**(_COMMON | _MLA | dict(q_lora_rank=8)), n_routed_experts=8,
                              num_experts_per_tok=2, mlp_layer_types=["sparse", "sparse"],
                              n_group=4, topk_group=2, routed_scaling_factor=1.8,
                              norm_topk_prob=False)
    return m.Glm4MoeLiteForCausalLM(cfg)


def _dots1():
    cfg = transformers.Dots1Config(**_COMMON, head_dim=8, intermediate_size=24,
                                   moe_intermediate_size=8, n_routed_experts=8,
                                   n_shared_experts=1, num_experts_per_tok=2,
                                   first_k_dense_replace=0, n_group=2, topk_group=1,
                                   routed_scaling_factor=2.0, norm_topk_prob=True)
    return transformers.Dots1ForCausalLM(cfg)


def _ernie4_5_moe():
    cfg = transformers.Ernie4_5_MoeConfig(**_COMMON, intermediate_size=24,
                                          moe_intermediate_size=8, moe_num_experts=8, moe_k=2,
                                          moe_num_shared_experts=1, moe_layer_start_index=0)
    return transformers.Ernie4_5_MoeForCausalLM(cfg)


def _hunyuan_v1_moe():
    cfg = transformers.HunYuanMoEV1Config(**_COMMON, head_dim=8, intermediate_size=8,
                                          num_experts=4, moe_topk=2)
    return transformers.HunYuanMoEV1ForCausalLM(cfg)


def _step3p7():
    from transformers.models.step3p7 import configuration_step3p7 as c
    from transformers.models.step3p7 import modeling_step3p7 as m

    text = {k: v for k, v in _COMMON.items() if k != "tie_word_embeddings"}
    text |= dict(head_dim=8, intermediate_size=24, moe_intermediate_size=8, share_expert_dim=12,
                 num_local_experts=8, n_routed_experts=8, num_experts_per_tok=2,
                 mlp_layer_types=["sparse", "sparse"], moe_router_scaling_factor=1.5,
                 pad_token_id=0, sliding_window=4)
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    cfg = c.Step3p7Config(text_config=text, vision_config=vision, image_token_id=VOCAB - 1)
    return m.Step3p7ForConditionalGeneration(cfg)


def _llama4(top_k=1, moe_step=1):
    # Llama-4's text model: the sigmoid score weights each expert's input (top-1, as the
    # released models; top-2 too), plus a shared expert. moe_step=2 interleaves a dense
    # layer (model.layers.0) before the MoE one, as the 128-expert model does.
    from transformers.models.llama4 import configuration_llama4 as c
    from transformers.models.llama4 import modeling_llama4 as m

    cfg = c.Llama4TextConfig(**_COMMON, head_dim=8, intermediate_size=8,
                             intermediate_size_mlp=24, num_local_experts=4,
                             num_experts_per_tok=top_k, interleave_moe_layer_step=moe_step)
    return m.Llama4ForCausalLM(cfg)


def _llama4_top2():
    return _llama4(top_k=2, moe_step=2)


FACTORIES = {"qwen3_moe": _qwen3_moe, "qwen2_moe": _qwen2_moe, "qwen3_5_moe": _qwen3_5_moe,
             "mixtral": _mixtral, "olmoe": _olmoe, "deepseek_v2": _deepseek_v2,
             "deepseek_v3": _deepseek_v3, "glm4_moe": _glm4_moe, "minimax_m2": _minimax_m2,
             "minimax_m3": _minimax_m3, "gpt_oss": _gpt_oss, "qwen3_next": _qwen3_next,
             "qwen3_vl_moe": _qwen3_vl_moe, "deepseek_v32": _deepseek_v32,
             "glm4_moe_lite": _glm4_moe_lite, "dots1": _dots1, "ernie4_5_moe": _ernie4_5_moe,
             "hunyuan_v1_moe": _hunyuan_v1_moe, "step3p7": _step3p7, "llama4": _llama4,
             "llama4_top2": _llama4_top2}
SUPPORTED = list(FACTORIES)
# Factories that are a variant of a preset, under another name.
VARIANTS = {"llama4_top2": "llama4"}


def preset_of(name: str):
    """The preset a factory's model converts with."""
    return PRESETS[VARIANTS.get(name, name)]


def available(name: str) -> bool:
    """Whether the installed transformers has the preset's model (newer ones, e.g.
    minimax_m3, deepseek_v32 or step3p7, are missing from older transformers: their tests
    skip)."""
    return preset_of(name).available()


AVAILABLE = [n for n in SUPPORTED if available(n)]


def preset_params(names):
    """``names`` as pytest parameters, each skipped where transformers lacks its model."""
    import pytest

    return [pytest.param(n, marks=pytest.mark.skipif(
        not available(n), reason=f"{n} needs transformers >= {preset_of(n).min_transformers}"))
        for n in names]


def make_model(name: str, seed: int = 0):
    """A float32 model with non-degenerate routing: weights N(0, 0.02), routers N(0, 1)
    (HunYuan's ``gate.wg`` and Llama-4's ``feed_forward.router`` too), experts N(0, 0.1)
    (GPT-OSS's expert biases included), score-correction biases N(0, 0.5) (buffers, and
    ERNIE-4.5's frozen parameter), so scores are far from ties; other 1-d parameters
    (GPT-OSS's router bias) N(0, 0.1)."""
    torch.manual_seed(seed)
    model = FACTORIES[name]().float()
    model.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname and p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif pname.endswith(("mlp.gate.weight", "mlp.router.weight", "mlp.gate.wg.weight",
                                 "feed_forward.router.weight")):
                p.copy_(torch.randn(p.shape, generator=g))
            elif pname.endswith("e_score_correction_bias"):  # ERNIE-4.5's, a frozen parameter
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "experts.gate_up_proj" in pname or "experts.down_proj" in pname:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif ".linear_attn." in pname:
                # Qwen3.5's gated delta net: HF's own A_log/dt_bias; projections large
                # enough that the l2-normalised q/k do not amplify rounding (1/|q|).
                if p.dim() > 1:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g) if p.dim() > 1
                        else 0.1 * torch.randn(p.shape, generator=g))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
    return model


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, ids.clone()


def run(model, ids, labels):
    """Forward with labels and router logits, backward of the loss; returns the outputs."""
    out = model(input_ids=ids, labels=labels, output_router_logits=True, use_cache=False)
    out.loss.backward()
    return out


class _KeepFloat64(TorchFunctionMode):
    """Float64 stays float64 where HF's code casts to float32 (router softmaxes, the loss's
    upcast, DeepSeek's float32 router), so that a float64 model is a float64 oracle; random
    draws into float64 tensors take float32's values (Mixtral's jitter), as the float32
    models draw them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        this = args[0] if args and isinstance(args[0], torch.Tensor) else None
        # Casts to float32 become casts to float64, of float64 tensors and of others alike
        # (an int tensor's .float() meets float64 operands: older transformers' rotary
        # embedding multiplies position ids, cast so, with a float64 buffer).
        if this is not None and func is torch.Tensor.float:
            return this.to(torch.float64)
        if this is not None and func in (torch.Tensor.to, torch.Tensor.type):
            if (this.dtype == torch.float64 and len(args) > 1
                    and isinstance(args[1], torch.Tensor)):  # .to(other)
                args = (this, args[1].device, args[1].dtype, *args[2:])
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if this is not None and this.dtype == torch.float64 and func is torch.Tensor.uniform_:
            draw = torch.empty_like(this, dtype=torch.float32).uniform_(*args[1:], **kwargs)
            return this.copy_(draw)
        if kwargs.get("dtype") is torch.float32:  # factories and casts alike
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def float64_twin(module):
    """A float64 copy of an HF model or block, without gradient checkpointing: the oracle
    (run it through ``run64``). HF's grouped_mm experts have no float64 kernel: eager."""
    twin = copy.deepcopy(module).double()
    twin.zero_grad(set_to_none=True)
    if getattr(twin, "is_gradient_checkpointing", False):
        getattr(twin, "activation_checkpointing_disable", twin.gradient_checkpointing_disable)()
    for m in twin.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_experts_implementation"):
            cfg._experts_implementation = "eager"
    return twin


def keep_float64():
    """The context in which a ``float64_twin`` computes in float64 throughout."""
    return _KeepFloat64()


def run64(twin, ids, labels):
    """``run`` of a ``float64_twin``, float64 throughout."""
    with keep_float64():
        return run(twin, ids, labels)


class Parity:
    """Outputs and gradients of a converted model (``got``), of the HF model it came from
    (plain float32 PyTorch) and of that model's float64 twin, checked together by the
    tolerance rule (``assert_jointly_close_to_ref``): one model's results are one
    composite, whose small entries (a loss, a bias gradient) alone are too few samples."""

    def __init__(self, name):
        self.name, self.names, self.got, self.plain, self.ref64 = name, [], [], [], []

    def add(self, what, got, plain, ref64):
        assert ref64.dtype == torch.float64, f"{self.name} {what}: the oracle is {ref64.dtype}"
        self.names.append(f"{self.name} {what}")
        self.got.append(got)
        self.plain.append(plain)
        self.ref64.append(ref64)

    def add_outputs(self, got, want, want64):
        self.add("logits", got.logits, want.logits, want64.logits)
        self.add("loss", got.loss, want.loss, want64.loss)
        rl_want = getattr(want, "router_logits", None)
        if rl_want is not None:
            assert got.router_logits is not None and len(got.router_logits) == len(rl_want)
            assert len(rl_want) > 0, f"{self.name}: the reference recorded no router logits"
            for i, (g, w, w64) in enumerate(zip(got.router_logits, rl_want,
                                                 want64.router_logits)):
                self.add(f"router_logits[{i}]", g, w, w64)
        aux_want = getattr(want, "aux_loss", None)
        if aux_want is not None:
            self.add("aux_loss", got.aux_loss, aux_want, want64.aux_loss)

    def check(self):
        assert self.got, f"{self.name}: nothing compared"
        assert_jointly_close_to_ref(self.got, self.plain, self.ref64, self.names)
