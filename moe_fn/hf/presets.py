"""Presets: what each Hugging Face MoE block computes, written as a MoEConfig plus the code
HF runs around its routed experts (shared experts, their gates, jitter, the return value).

Each preset names the HF block class, its router and experts children, where the
score-correction bias lives, and how the router's logits are computed (dtype). The
routing maps (transformers 5.x modeling code is the reference):

=============  =========  =========  ===========================  ======  ==============
preset         scores     top-k norm groups (n_group/topk/score)  bias    activation
=============  =========  =========  ===========================  ======  ==============
qwen3_moe      softmax    config     -                            -       swiglu
qwen2_moe      softmax    config     -                            -       swiglu
qwen3_5_moe    softmax    always     -                            -       swiglu
mixtral        softmax    always     -                            -       swiglu
olmoe          softmax    config     -                            -       swiglu
deepseek_v2    softmax    never      group_limited_greedy: max    -       swiglu
deepseek_v3    sigmoid    config     n_group/topk_group: top2_sum gate    swiglu
glm4_moe       sigmoid    config     n_group/topk_group: top2_sum gate    swiglu
minimax_m2     sigmoid    always     -                            block   swiglu
minimax_m3     sigmoid    always     -                            gate    swiglu_oai
gpt_oss        softmax_topk  -       -                            -       swiglu_oai (interleaved)
qwen3_next     softmax    config     -                            -       swiglu
qwen3_vl_moe   softmax    always     -                            -       swiglu
deepseek_v32   sigmoid    config     n_group/topk_group: top2_sum gate    swiglu
glm4_moe_lite  sigmoid    config     n_group/topk_group: top2_sum gate    swiglu
dots1          sigmoid    config     n_group/topk_group: top2_sum gate    swiglu
ernie4_5_moe   softmax    always     -                            gate    swiglu
hunyuan_v1_moe softmax    always     -                            -       swiglu
step3p7        sigmoid    always     -                            gate    swiglu
llama4         sigmoid    never      -                            -       swiglu (pre)
=============  =========  =========  ===========================  ======  ==============

GPT-OSS also has a router bias (``router.bias``, added to the logits) and per-expert biases
(``experts.gate_up_proj_bias`` after gate+up, ``experts.down_proj_bias`` after down, both
inside the routing weight, hence ``score_apply="post"`` only), and stores its experts
transposed (``gate_up_proj (E, H, 2I)``, ``down_proj (E, I, H)``), which the MoELayer reads as
``.transpose(1, 2)`` views: no copy. Its MLP returns ``(hidden, router_scores)``.

``routed_scaling_factor`` is read from the config for deepseek_v2/v3/v32, glm4_moe,
glm4_moe_lite, dots1 and minimax_m3, and step3p7's ``moe_router_scaling_factor`` (where HF
multiplies the experts' sum after the fact; the product is linear, so it moves into the
routing weights). DeepSeek-V2/V3/V3.2, GLM-4-MoE(-Lite), dots1 and ERNIE-4.5-MoE compute
router logits in float32; MiniMax and Step-3.7 cast the input to the router weight's dtype,
and HunYuan-MoE too (its ``gate.wg`` is a float32 ``nn.Linear``: the router weight is at
``gate.wg.weight``).

ERNIE-4.5-MoE's score-correction bias is a frozen ``(1, E)`` parameter
(``gate.moe_statics.e_score_correction_bias``, read as its ``(E,)`` view) added to the
softmax probabilities for the choice only; HF divides the chosen probabilities by
``clamp(sum, min=moe_norm_min)`` where moe_fn divides by ``sum + 1e-20``: equal in float32
while the sum is at least ``moe_norm_min`` = 1e-12 (the config's default; a larger one is
refused), i.e. unless every chosen expert's probability underflows. Qwen3-VL-MoE's text
blocks convert (the vision tower has no MoE). Step-3.7's experts clamp *after* the SiLU
(``min(silu(g), L)``) on layers with a ``swiglu_limits`` entry, which no moe_fn activation
computes: such a block is refused (convert the others with ``moe_layer_pattern``).

Llama-4 (``Llama4TextMoe``) weights each expert's INPUT: every expert runs on
``x * sigmoid(logit)`` for its chosen tokens (``x * 0`` for the others, which a bias-free
gated MLP maps to 0 with no gradient), so its routing sets ``score_apply="pre"`` itself
(``derived_options``: a user's score_apply is refused). HF chooses the top-k on the raw
logits (in the router's dtype) and takes the sigmoid (in float32, cast back to the logits'
dtype) of the chosen ones only, never normalised; moe_fn's ``"sigmoid"`` would choose on
the float32 sigmoids, which round distinct logits to equal values (all logits above ~17,
or a few ulps apart), and then break the tie by index where HF takes the larger logit. So
the preset chooses on the logits (``choose_on_logits``: one extra no-grad router linear,
then the MoELayer weighs the chosen experts as a replayed route). Its router (an
``nn.Linear``, ``router.weight``) returns ``(scores, logits)``, which output capture reads
at index 1; the block returns ``(out (T, H), router_logits)``, its experts are stored
transposed (``(E, H, 2I)``, gate and up as halves: ``chunk(2)``) and its shared expert
(``shared_expert``) runs on ``x``. Only the decoder layers in ``config.moe_layers`` hold a
``Llama4TextMoe`` (``interleave_moe_layer_step``); the others are dense MLPs, left alone.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F

# HF ``hidden_act`` of the experts -> our gated activation.
# gelu_new and gelu_fast are HF's other spellings of the tanh approximation.
HIDDEN_ACT = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu_tanh",
              "gelu_new": "geglu_tanh", "gelu_fast": "geglu_tanh"}


def _act(cfg) -> dict:
    act = getattr(cfg, "hidden_act", "silu")
    if act not in HIDDEN_ACT:
        raise ValueError(f"hidden_act={act!r} of the experts has no gated activation in "
                         f"moe_fn (supported: {sorted(HIDDEN_ACT)})")
    return {"activation": HIDDEN_ACT[act]}


def _softmax(cfg, norm) -> dict:
    return dict(score_func="softmax",
                norm_topk_prob=bool(norm if isinstance(norm, bool) else getattr(cfg, norm)))


# Sizes (E, I, H) come from the experts' parameters and top_k from the router module, so
# the routing functions only map the routing rule and the activation.


def _routing_qwen3(cfg):
    return _softmax(cfg, "norm_topk_prob") | _act(cfg)


def _routing_normalised(cfg):
    # Qwen3.5-MoE's and Mixtral's routers always normalise the top-k probabilities.
    return _softmax(cfg, True) | _act(cfg)


def _routing_deepseek_v2(cfg):
    # DeepSeek-V2 never normalises (it ignores norm_topk_prob).
    out = _softmax(cfg, False)
    method = getattr(cfg, "topk_method", "greedy")
    if method == "group_limited_greedy":
        groups = (getattr(cfg, "n_group", None), getattr(cfg, "topk_group", None))
        if not all(isinstance(g, int) and g > 0 for g in groups):
            raise ValueError("deepseek_v2: topk_method='group_limited_greedy' needs positive "
                             f"integer n_group and topk_group in the config, got {groups}")
        out |= dict(n_group=groups[0], topk_group=groups[1], group_score="max")
    elif method != "greedy":
        raise ValueError(f"deepseek_v2: topk_method={method!r} is not supported "
                         "(supported: 'greedy', 'group_limited_greedy')")
    return out | dict(routed_scaling_factor=float(cfg.routed_scaling_factor)) | _act(cfg)


def _routing_deepseek_v3(cfg):
    # HF always runs the group selection, n_group=1 included (top-2 sum of one group).
    return dict(score_func="sigmoid", norm_topk_prob=bool(cfg.norm_topk_prob),
                n_group=int(cfg.n_group or 1), topk_group=int(cfg.topk_group or 1),
                group_score="top2_sum", score_correction_bias=True,
                routed_scaling_factor=float(cfg.routed_scaling_factor)) | _act(cfg)


def _routing_minimax_m2(cfg):
    return dict(score_func="sigmoid", norm_topk_prob=True,
                score_correction_bias=True) | _act(cfg)


def _routing_minimax_m3(cfg):
    # hidden_act is ignored by HF here: the gate is computed inline from swiglu_alpha/limit.
    return dict(score_func="sigmoid", norm_topk_prob=True, score_correction_bias=True,
                routed_scaling_factor=float(cfg.routed_scaling_factor),
                activation="swiglu_oai", activation_alpha=float(cfg.swiglu_alpha),
                activation_limit=float(cfg.swiglu_limit))


def _routing_ernie4_5_moe(cfg):
    # Softmax probabilities plus the score-correction bias choose; the chosen (unbiased)
    # probabilities are divided by clamp(sum, min=moe_norm_min): our sum + 1e-20 equals it
    # in float32 whenever sum >= 1e-12, so a larger moe_norm_min is refused.
    norm_min = float(getattr(cfg, "moe_norm_min", 1e-12))
    if norm_min > 1e-12:
        raise ValueError(f"ernie4_5_moe: moe_norm_min={norm_min} > 1e-12 floors the top-k sum "
                         "where moe_fn divides by sum + 1e-20: not the same weights")
    return _softmax(cfg, True) | dict(score_correction_bias=True) | _act(cfg)


def _routing_step3p7(cfg):
    # HF multiplies the experts' sum by moe_router_scaling_factor (linear: a routing weight).
    return dict(score_func="sigmoid", norm_topk_prob=True, score_correction_bias=True,
                routed_scaling_factor=float(getattr(cfg, "moe_router_scaling_factor", 1.0))
                ) | _act(cfg)


def _check_step3p7(block):
    # Step-3.7 clamps after the activation, min(silu(g), L), on layers with a swiglu_limits
    # entry; no moe_fn activation computes that (swiglu_clamped is silu(min(g, L))).
    limit = getattr(getattr(block, "experts", None), "limit", float("inf"))
    if limit != float("inf"):
        return (f"its experts clamp after the SiLU (swiglu_limits entry {limit}: "
                "min(silu(gate), L) * clamp(up, -L, L)), which no moe_fn activation computes")
    return None


def _routing_llama4(cfg):
    # sigmoid of the chosen logits, never normalised, weighting the experts' inputs.
    return dict(score_func="sigmoid", norm_topk_prob=False, score_apply="pre") | _act(cfg)


def _routing_gpt_oss(cfg):
    # hidden_act is ignored by HF's experts: the gate is computed inline from swiglu_alpha/limit
    # (config fields in newer transformers; before them, 5.17 and older, fixed at these values).
    return dict(score_func="softmax_topk", norm_topk_prob=False, activation="swiglu_oai",
                activation_alpha=float(getattr(cfg, "swiglu_alpha", 1.702)),
                activation_limit=float(getattr(cfg, "swiglu_limit", 7.0)),
                gate_up_layout="interleaved", router_bias=True, expert_bias=True)


# --- what HF computes around the routed experts -------------------------------------------
# ``routed(x)`` maps (..., H) -> (..., H): the routing-weighted sum of the experts (and it
# records the router logits where HF's output capture expects them).


def _jitter(block, hidden_states):
    # Mixtral / MiniMax-M2: multiplicative input jitter in training, in place as in HF.
    if block.training and block.jitter_noise > 0:
        hidden_states *= torch.empty_like(hidden_states).uniform_(
            1.0 - block.jitter_noise, 1.0 + block.jitter_noise)
    return hidden_states


def forward_plain(block, hidden_states, routed):
    return routed(hidden_states)


def forward_jitter(block, hidden_states, routed):
    return routed(_jitter(block, hidden_states))


def forward_gated_shared(block, hidden_states, routed):
    """Qwen2-MoE / Qwen3.5-MoE: routed + sigmoid(shared_expert_gate(x)) * shared_expert(x)."""
    b, s, h = hidden_states.shape
    x = hidden_states.view(-1, h)
    shared = block.shared_expert(x)
    out = routed(x)
    shared = F.sigmoid(block.shared_expert_gate(x)) * shared
    return (out + shared).reshape(b, s, h)


def forward_shared(block, hidden_states, routed):
    """DeepSeek-V2/V3, GLM-4-MoE, MiniMax-M3 (its routed_scaling_factor folded into the
    routing weights): routed + shared_experts(x)."""
    return routed(hidden_states) + block.shared_experts(hidden_states)


def forward_optional_shared(block, hidden_states, routed):
    """ERNIE-4.5-MoE: routed + shared_experts(x), shared experts only when the config has
    some (moe_num_shared_experts > 0)."""
    out = routed(hidden_states)
    if block.shared_experts is not None:
        out = out + block.shared_experts(hidden_states)
    return out


def forward_shared_mlp(block, hidden_states, routed):
    """HunYuan-MoE: routed + shared_mlp(x)."""
    return routed(hidden_states) + block.shared_mlp(hidden_states)


def forward_gpt_oss(block, hidden_states, routed):
    """GPT-OSS: ``(routed, router_scores)``; the scores (softmax over the top-k logits, as
    HF's router returns them) are what HF's MLP returns beside its output (its decoder
    layer discards them)."""
    b, s, h = hidden_states.shape
    out, logits = routed(hidden_states.reshape(-1, h), return_router_logits=True)
    top = torch.topk(logits, block.router.top_k, dim=-1).values
    scores = F.softmax(top, dim=1, dtype=top.dtype)
    return out.reshape(b, s, h), scores


def forward_llama4(block, hidden_states, routed):
    """Llama-4: ``(shared_expert(x) + routed, router_logits)`` on the flattened tokens, as
    HF's block returns them (its decoder layer views the output back and discards the
    logits)."""
    x = hidden_states.reshape(-1, block.hidden_dim)
    out, logits = routed(x, return_router_logits=True)
    return block.shared_expert(x) + out, logits


# --- what HF's router is called with and returns ------------------------------------------
# A converted block calls its router once per forward so that hooks on it (HF's output
# capture, a user's reader) see what HF's router sees: the router's input as HF's block
# passes it, and its output built from what the MoELayer computed (the logits, and, when
# a hook is registered, the routing weights and expert indices).


def router_input_tokens(block, x):
    """The flattened tokens ``(T, H)``, as most blocks pass them."""
    return (x.reshape(-1, x.shape[-1]),)


def router_input_as_given(block, x):
    """The block's input as it came (DeepSeek, GLM, dots1: the router flattens it)."""
    return (x,)


def router_input_minimax_m2(block, x):
    """MiniMax-M2: the tokens and the block's score-correction bias."""
    return x.reshape(-1, x.shape[-1]), block.e_score_correction_bias


def router_output_default(logits, weights=None, indices=None):
    """HF's router output ``(router_logits (T, E), top-k weights (T, k), top-k indices (T,
    k) int64)``; weights and indices None when no hook will read them."""
    return logits, weights, indices


def router_output_llama4(logits, weights=None, indices=None):
    """Llama-4's router returns ``(router_scores (T, E), router_logits)``: the scores are
    each chosen expert's routing weight and 0 elsewhere (HF's sigmoid of -inf); None when
    no hook will read them. Output capture reads index 1."""
    if weights is None:
        return None, logits
    scores = logits.new_zeros(logits.shape).scatter(1, indices, weights.to(logits.dtype))
    return scores, logits


@attrs.frozen(kw_only=True)
class Preset:
    """One HF MoE family.

    name: the preset's name; model_types: the ``config.model_type`` values it serves.
    module: the transformers modeling module; block_class: the block's class name in it.
    router_attr / experts_attr: the block's children. router_weight: dotted path (from the
    router) of its weight (HunYuan: ``wg.weight``). bias_attr: dotted path (from the
    block) of the ``e_score_correction_bias`` buffer (a ``(1, E)`` one, ERNIE's, is read as
    its ``(E,)`` view), or None.
    router_dtype: None (logits in the weight's dtype from the input as it comes),
    "float32" (input and weight cast to float32, DeepSeek), "weight" (input cast to the
    weight's dtype, MiniMax). transposed: the experts store ``gate_up_proj (E, H, 2I)`` and
    ``down_proj (E, I, H)`` (GPT-OSS); the MoELayer reads them as ``.transpose(1, 2)`` views.
    Router and expert biases (GPT-OSS: ``router.bias``, ``experts.gate_up_proj_bias``,
    ``experts.down_proj_bias``) are read when ``routing`` sets ``router_bias`` /
    ``expert_bias``. routing: HF text config -> MoEConfig fields. forward:
    ``(block, hidden_states, routed) -> what HF's block returns``. check: None, or
    ``(block) -> None | reason``: a reason refuses that block (before any is converted),
    for a block whose own settings the MoELayer cannot compute (Step-3.7's clamped layers).
    router_input: ``(block, x) -> the arguments HF's block calls its router with`` (``x``
    the block's input to its routed experts). router_output: ``(logits, weights, indices)
    -> the tuple HF's router returns``, with the MoELayer's logits where HF's output capture
    reads them. router_weights_dtype: the dtype of HF's routing weights: "logits" (cast to
    the logits' dtype), "float32" or "input" (the router input's, ERNIE-4.5).
    router_weights_scaled: whether HF's routing weights include ``routed_scaling_factor``
    (False: MiniMax-M3 and Step-3.7 scale the experts' sum after the fact, and the router's
    weights are the layer's divided by it). choose_on_logits: HF takes the top-k on the raw
    logits, not on the scores (Llama-4: sigmoid after the choice). derived_options: MoEConfig
    options outside ``DERIVED`` that ``routing`` sets (Llama-4's ``score_apply``), refused
    from the user with ``derived_reason``.
    """

    name: str
    model_types: tuple[str, ...]
    module: str
    block_class: str
    routing: Callable
    forward: Callable
    router_attr: str = "gate"
    router_weight: str = "weight"
    experts_attr: str = "experts"
    bias_attr: str | None = None
    router_dtype: str | None = None
    transposed: bool = False
    check: Callable | None = None
    router_input: Callable = router_input_tokens
    router_output: Callable = router_output_default
    router_weights_dtype: str = attrs.field(
        default="logits", validator=attrs.validators.in_(("logits", "float32", "input")))
    router_weights_scaled: bool = True
    choose_on_logits: bool = False
    derived_options: tuple[str, ...] = ()
    derived_reason: str = ""
    min_transformers: str = "5.0.0"

    def available(self) -> bool:
        """Whether the installed transformers has this preset's modeling module."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except ImportError:  # pragma: no cover - a missing parent package
            return False

    def modeling(self):
        try:
            return importlib.import_module(self.module)
        except ImportError as e:  # pragma: no cover - depends on the installed transformers
            raise ValueError(f"preset {self.name!r} needs transformers >= "
                             f"{self.min_transformers} ({self.module} not importable: {e})") from e

    def cls(self, which: str):
        mod = self.modeling()
        name = getattr(self, f"{which}_class")
        try:
            return getattr(mod, name)
        except AttributeError as e:  # pragma: no cover - depends on the installed transformers
            raise ValueError(f"preset {self.name!r}: {self.module} has no {name}; it needs "
                             f"transformers >= {self.min_transformers}") from e


def _p(name, model_types, stem, block, routing, forward, **kw) -> Preset:
    return Preset(name=name, model_types=tuple(model_types),
                  module=f"transformers.models.{stem}.modeling_{stem}", block_class=block,
                  routing=routing, forward=forward, **kw)


# DeepSeek's, GLM's and dots1's routers: logits and weights in float32, on the block's input
# as it comes.
_FLOAT32_ROUTER = dict(router_dtype="float32", router_input=router_input_as_given,
                       router_weights_dtype="float32")

PRESETS: dict[str, Preset] = {p.name: p for p in [
    _p("qwen3_moe", ["qwen3_moe"], "qwen3_moe", "Qwen3MoeSparseMoeBlock", _routing_qwen3,
       forward_plain),
    _p("qwen2_moe", ["qwen2_moe"], "qwen2_moe", "Qwen2MoeSparseMoeBlock", _routing_qwen3,
       forward_gated_shared),
    _p("qwen3_5_moe", ["qwen3_5_moe", "qwen3_5_moe_text"], "qwen3_5_moe",
       "Qwen3_5MoeSparseMoeBlock", _routing_normalised, forward_gated_shared,
       min_transformers="5.2.0"),
    _p("mixtral", ["mixtral"], "mixtral", "MixtralSparseMoeBlock", _routing_normalised,
       forward_jitter, router_weights_dtype="float32"),
    _p("olmoe", ["olmoe"], "olmoe", "OlmoeSparseMoeBlock", _routing_qwen3, forward_plain),
    _p("deepseek_v2", ["deepseek_v2"], "deepseek_v2", "DeepseekV2Moe", _routing_deepseek_v2,
       forward_shared, **_FLOAT32_ROUTER),
    _p("deepseek_v3", ["deepseek_v3"], "deepseek_v3", "DeepseekV3MoE", _routing_deepseek_v3,
       forward_shared, bias_attr="gate.e_score_correction_bias", **_FLOAT32_ROUTER),
    _p("glm4_moe", ["glm4_moe"], "glm4_moe", "Glm4MoeMoE", _routing_deepseek_v3,
       forward_shared, bias_attr="gate.e_score_correction_bias", **_FLOAT32_ROUTER),
    _p("minimax_m2", ["minimax_m2"], "minimax_m2", "MiniMaxM2SparseMoeBlock",
       _routing_minimax_m2, forward_jitter, bias_attr="e_score_correction_bias",
       router_dtype="weight", router_input=router_input_minimax_m2,
       router_weights_dtype="float32"),
    _p("minimax_m3", ["minimax_m3_vl", "minimax_m3_vl_text"], "minimax_m3_vl",
       "MiniMaxM3VLSparseMoeBlock", _routing_minimax_m3, forward_shared,
       bias_attr="gate.e_score_correction_bias", router_dtype="weight",
       router_weights_dtype="float32", router_weights_scaled=False,
       min_transformers="5.15.0"),
    _p("gpt_oss", ["gpt_oss"], "gpt_oss", "GptOssMLP", _routing_gpt_oss, forward_gpt_oss,
       router_attr="router", transposed=True),
    _p("qwen3_next", ["qwen3_next"], "qwen3_next", "Qwen3NextSparseMoeBlock", _routing_qwen3,
       forward_gated_shared),
    _p("qwen3_vl_moe", ["qwen3_vl_moe", "qwen3_vl_moe_text"], "qwen3_vl_moe",
       "Qwen3VLMoeTextSparseMoeBlock", _routing_normalised, forward_plain),
    _p("deepseek_v32", ["deepseek_v32"], "deepseek_v32", "DeepseekV32MoE", _routing_deepseek_v3,
       forward_shared, bias_attr="gate.e_score_correction_bias", min_transformers="5.11.0",
       **_FLOAT32_ROUTER),
    _p("glm4_moe_lite", ["glm4_moe_lite"], "glm4_moe_lite", "Glm4MoeLiteMoE",
       _routing_deepseek_v3, forward_shared, bias_attr="gate.e_score_correction_bias",
       **_FLOAT32_ROUTER),
    _p("dots1", ["dots1"], "dots1", "Dots1MoE", _routing_deepseek_v3, forward_shared,
       bias_attr="gate.e_score_correction_bias", **_FLOAT32_ROUTER),
    _p("ernie4_5_moe", ["ernie4_5_moe"], "ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock",
       _routing_ernie4_5_moe, forward_optional_shared,
       bias_attr="gate.moe_statics.e_score_correction_bias", router_dtype="float32",
       router_weights_dtype="input"),
    _p("hunyuan_v1_moe", ["hunyuan_v1_moe"], "hunyuan_v1_moe", "HunYuanMoEV1Moe",
       _routing_normalised, forward_shared_mlp, router_weight="wg.weight",
       router_dtype="weight"),
    # Step-3.7's text config says model_type "step3p5" (there is no step3p5 model of its own).
    _p("step3p7", ["step3p7", "step3p5"], "step3p7", "Step3p7SparseMoeBlock",
       _routing_step3p7, forward_shared, bias_attr="gate.e_score_correction_bias",
       router_dtype="weight", router_weights_dtype="float32", router_weights_scaled=False,
       check=_check_step3p7, min_transformers="5.16.0"),
    # The Llama-4 text model, alone or inside Llama4ForConditionalGeneration. Its MoE block,
    # router and experts read the same in transformers 5.0.0, 5.12.0 and 5.24.0; up to at
    # least 5.12 HF's output capture records the block's output 0 as "router_logits" (not the
    # router's logits), which the converted block returns alike (its tests pass on 5.12.0).
    _p("llama4", ["llama4", "llama4_text"], "llama4", "Llama4TextMoe", _routing_llama4,
       forward_llama4, router_attr="router", transposed=True, choose_on_logits=True,
       router_output=router_output_llama4, derived_options=("score_apply",),
       derived_reason="HF's Llama-4 weights each expert's input (x * sigmoid(logit)), "
                      "which is score_apply='pre' ('post' and 'activation' would weight a "
                      "nonlinear expert's output: another function)"),
]}

MODEL_TYPES: dict[str, str] = {mt: p.name for p in PRESETS.values() for mt in p.model_types}
