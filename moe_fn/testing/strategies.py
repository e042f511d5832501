"""Hypothesis strategies for MoE property tests (needs ``hypothesis``).

- :func:`moe_configs`: valid ``MoEConfig`` objects over every routing variant,
  activation, packing, bias and weighting placement the layer supports.
- :func:`moe_cases`: a config with float64 parameters, inputs and an output cotangent,
  where some experts are steered to receive no rows and the token count may be 0.
- :func:`tokens_per_rank`: token counts for the ranks of an expert-parallel group, ranks
  with no tokens included.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs
import torch
from hypothesis import strategies as st

from .. import MoEConfig
from .reference import MoEParams, random_params

ACTIVATIONS = ("swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh")
LAYOUTS = ("halves", "interleaved")
SCORE_FUNCS = ("softmax", "sigmoid", "softmax_topk")
GROUP_SCORES = ("top2_sum", "max")
SCORE_APPLY = ("post", "pre", "activation")
GATE_UP_IMPLS = ("fused", "separate")
# The layer's implementation switches and their values; kept in this one place. Only those
# MoEConfig has are drawn.
IMPL_OPTIONS = {"impl": ("fused", "reference")}
# Small limits so that random pre-activations reach both sides of the clamps.
LIMITS = (None, 0.5, 2.0)
ALPHAS = (None, 1.5)
# How far below the others a steered expert's logits sit.
STEER = 40.0


@st.composite
def moe_configs(draw, *, max_hidden: int = 8, max_intermediate: int = 6,
                max_experts: int = 8, **fixed) -> MoEConfig:
    """A valid ``MoEConfig`` (single rank). ``fixed`` pins options (e.g.
    ``score_apply="post"``); everything else is drawn."""
    kw = {}
    kw["hidden_size"] = draw(st.integers(2, max_hidden))
    kw["intermediate_size"] = draw(st.integers(1, max_intermediate))
    n_group = draw(st.sampled_from([1, 1, 2, 4]))
    per_group = draw(st.integers(1 if n_group == 1 else 2, max(2, max_experts // n_group)))
    kw["num_experts"] = e = n_group * per_group
    if n_group > 1:
        kw.update(n_group=n_group, topk_group=draw(st.integers(1, n_group)),
                  group_score=draw(st.sampled_from(GROUP_SCORES)))
        eligible = kw["topk_group"] * per_group
    else:
        eligible = e
    kw["top_k"] = draw(st.integers(1, eligible))
    kw["score_func"] = draw(st.sampled_from(SCORE_FUNCS))
    kw["norm_topk_prob"] = draw(st.booleans())
    kw["score_correction_bias"] = draw(st.booleans())
    kw["routed_scaling_factor"] = draw(st.sampled_from([1.0, 2.5]))
    kw["router_bias"] = draw(st.booleans())
    act = kw["activation"] = draw(st.sampled_from(ACTIVATIONS))
    if act in ("swiglu_clamped", "swiglu_oai"):
        kw["activation_limit"] = draw(st.sampled_from(LIMITS))
    if act == "swiglu_oai":
        kw["activation_alpha"] = draw(st.sampled_from(ALPHAS))
    kw["gate_up_layout"] = draw(st.sampled_from(LAYOUTS))
    kw["gate_up_impl"] = draw(st.sampled_from(GATE_UP_IMPLS))
    kw["expert_bias"] = draw(st.booleans())
    kw["score_apply"] = "post" if kw["expert_bias"] else draw(st.sampled_from(SCORE_APPLY))
    fields = attrs.fields_dict(MoEConfig)
    for name, values in IMPL_OPTIONS.items():
        if name in fields:
            kw[name] = draw(st.sampled_from(values))
    kw.update(fixed)
    try:
        return MoEConfig(**kw)
    except ValueError:
        # A combination the layer refuses (e.g. a fused option with another placement).
        for name in IMPL_OPTIONS:
            if name in fields and name not in fixed:
                kw[name] = fields[name].default
        return MoEConfig(**kw)


class MoECase(NamedTuple):
    """A config with everything one float64 forward and backward needs.

    params: all experts' tensors (float64); x ``(T, H)`` with T possibly 0; d_out
    ``(T, H)``; empty_experts: experts steered so that no token chooses them (their
    weight gradients must be zero).
    """

    config: MoEConfig
    params: MoEParams
    x: torch.Tensor
    d_out: torch.Tensor
    empty_experts: frozenset


@st.composite
def moe_cases(draw, configs=None, *, max_tokens: int = 6, tokens=None) -> MoECase:
    """A :class:`MoECase` from ``configs`` (default :func:`moe_configs`) with a token count
    drawn from ``tokens`` (default 0 to ``max_tokens``). Without expert groups, a drawn set
    of experts (at most ``E - top_k``) is steered empty: x's first feature is 1 for every
    token and those experts' router weight there is ``-40`` (their choice bias, if any,
    ``-10``)."""
    cfg = draw(configs if configs is not None else moe_configs())
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    t = draw(tokens if tokens is not None else st.integers(0, max_tokens))
    params = random_params(cfg, generator=gen)
    x = torch.randn(t, cfg.hidden_size, generator=gen, dtype=torch.float64)
    d_out = torch.randn(t, cfg.hidden_size, generator=gen, dtype=torch.float64)
    empty = frozenset()
    if cfg.n_group == 1 and cfg.num_experts > cfg.top_k:
        empty = frozenset(draw(st.sets(st.integers(0, cfg.num_experts - 1),
                                       max_size=cfg.num_experts - cfg.top_k)))
    if empty:
        x[:, 0] = 1.0
        rows = sorted(empty)
        params.router_weight[:, 0] = 0.0
        params.router_weight[rows, 0] = -STEER
        if params.router_bias is not None:
            params.router_bias[rows] = 0.0
        if params.score_correction_bias is not None:
            params.score_correction_bias[rows] = -10.0
    return MoECase(cfg, params, x, d_out, empty)


def tokens_per_rank(world: int, *, max_tokens: int = 6):
    """Token counts, one per rank; ranks with 0 tokens (and all-zero groups) included."""
    return st.lists(st.integers(0, max_tokens), min_size=world, max_size=world)
