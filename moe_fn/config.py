"""MoEConfig: every option of an MoE layer, validated once when built (fail closed)."""

from __future__ import annotations

import functools
import re

import attrs
import torch

from .pure.activations import ACTIVATIONS, LAYOUTS, resolve_activation
from .pure.dispatch import PEER_MAX_RANKS
from .pure.router import router_validate

SCORE_APPLY = ("post", "pre", "activation")
IMPLS = ("fused", "reference")
GATE_UP_IMPLS = ("fused", "separate")
COMM_BACKENDS = ("local", "all_to_all", "symm_mem", "deepep")
DEEPEP_INTRANODE_SIZES = (2, 4, 8)
# DeepEP's intranode bf16 dispatch traps above this hidden size on SM90 (DeepEP issue #722).
DEEPEP_MAX_HIDDEN = 8184


# Options that no longer exist, each with what replaces it: passing one raises ValueError.
_IMPL = ("impl, one knob for the row weighting and the combine's sums: impl='fused' (the "
         "default, every exchange's fastest; was row_weighting_impl='fused', "
         "combine_impl='fused') or impl='reference' (was 'eager' for both)")
REMOVED_OPTIONS = {
    "row_weighting_impl": _IMPL,
    "combine_impl": _IMPL,
    "all_to_all_dedup": "comm_backend: each token sent once per rank is what "
                        "comm_backend='symm_mem' (GPUs of one host) and 'deepep' do; the "
                        "token-once all_to_all was removed (never 5% faster than the "
                        "exchanges kept, docs/exchanges.md): use comm_backend='all_to_all', "
                        "'symm_mem' or 'deepep'",
    "all_to_all_transport": "comm_backend: 'symm_mem' is now comm_backend='symm_mem'; "
                            "'collective' is comm_backend='all_to_all' itself; 'registered' "
                            "and 'copy_engine' were removed (no faster than the exchanges "
                            "kept, docs/exchanges.md): use comm_backend='all_to_all' or "
                            "'symm_mem'",
}


def _refusing_removed_options(cls):
    """A removed option raises ValueError naming its replacement (attrs would raise a bare
    TypeError for an unknown keyword)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, **kwargs):
        for name in kwargs:
            if name in REMOVED_OPTIONS:
                raise ValueError(f"MoEConfig option {name!r} was removed: use "
                                 f"{REMOVED_OPTIONS[name]}")
        init(self, **kwargs)

    cls.__init__ = __init__
    return cls


# Values that no longer exist, by option: value -> what replaces it.
REMOVED_VALUES = {"impl": {"eager": "impl='reference'"}}


def _one_of(name, value, allowed):
    if value in REMOVED_VALUES.get(name, {}):
        raise ValueError(f"{name}={value!r} was removed: use {REMOVED_VALUES[name][value]}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@_refusing_removed_options
@attrs.frozen(kw_only=True)
class MoEConfig:
    """Options of one MoE layer. Built once; invalid combinations raise ``ValueError``.

    Sizes: ``hidden_size`` H, ``intermediate_size`` I (per expert), ``num_experts`` E,
    ``top_k`` experts per token. Routing: ``score_func``, ``norm_topk_prob``, expert groups
    (``n_group``, ``topk_group``, ``group_score``), ``score_correction_bias`` (a buffer that
    biases the choice only), ``routed_scaling_factor``. Experts: ``activation`` (with
    ``activation_alpha``/``activation_limit``; None = the activation's default),
    ``gate_up_layout`` and ``gate_up_impl``. Where routing weights apply: ``score_apply``
    ("post" after the experts, "pre" on their input rows, "activation" folded into the
    activation). Biases (GPT-OSS): ``router_bias`` adds a learned ``(E,)`` bias to the
    router logits; ``expert_bias`` adds ``gate_up_proj_bias (E, 2I)`` after gate+up and
    ``down_proj_bias (E, H)`` after down, inside each expert, and needs
    ``score_apply="post"`` (the routing weight scales the whole expert output, down bias
    included). Exchange: ``comm_backend``, ``ep_size``, ``comm_num_sm`` (SMs the
    communication kernels use and that overlapped GEMMs leave free). ``comm_backend``
    ``"all_to_all"`` moves rows with ``all_to_all_single``; ``"symm_mem"`` publishes what
    each rank holds in torch symmetric memory and the others read it over NVLink straight
    into place — each token once per rank for the dispatch, one float32 partial per
    (token, rank) for the combine — CUDA ranks of one host; on CPUs a gathering stand-in
    runs the same logic.
    Checkpointing:
    ``skip_recompute_combine`` (see the README's contract) and ``recompute_in_checkpoint``
    (False: inside a ``moe_fn.checkpoint`` / HF checkpointed block the layer keeps its
    activations from the forward and is not recomputed, trading the memory of an unchecked
    MoE layer for its second forward).
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    activation: str = "swiglu"
    activation_alpha: float | None = None
    activation_limit: float | None = None
    gate_up_layout: str = "halves"
    gate_up_impl: str = "fused"
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    score_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    expert_bias: bool = False
    score_apply: str = "post"
    impl: str = "fused"
    comm_backend: str = "local"
    ep_size: int = 1
    comm_num_sm: int = 20
    overlap_weight_grad: bool = False
    skip_recompute_combine: bool = False
    recompute_in_checkpoint: bool = True

    def __attrs_post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k", "n_group",
                     "topk_group", "ep_size", "comm_num_sm"):
            _positive_int(name, getattr(self, name))
        # The routing options, by the same rules the router applies at every call.
        router_validate(self.num_experts, top_k=self.top_k, score_func=self.score_func,
                        norm_topk_prob=self.norm_topk_prob, n_group=self.n_group,
                        topk_group=self.topk_group, group_score=self.group_score,
                        routed_scaling_factor=self.routed_scaling_factor)
        _one_of("activation", self.activation, ACTIVATIONS)
        try:
            resolve_activation(self.activation, self.activation_alpha, self.activation_limit)
        except ValueError as e:  # the functional API's names, said as this config's options
            raise ValueError(re.sub(r"\b(alpha|limit)\b", r"activation_\1", str(e))) from None
        _one_of("gate_up_layout", self.gate_up_layout, LAYOUTS)
        _one_of("gate_up_impl", self.gate_up_impl, GATE_UP_IMPLS)
        _one_of("score_apply", self.score_apply, SCORE_APPLY)
        _one_of("impl", self.impl, IMPLS)
        _one_of("comm_backend", self.comm_backend, COMM_BACKENDS)
        for name in ("score_correction_bias", "router_bias", "expert_bias",
                     "overlap_weight_grad", "skip_recompute_combine", "recompute_in_checkpoint"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self._check_exchange()
        self._check_weighting()
        self._check_overlap()
        if self.skip_recompute_combine and not self.recompute_in_checkpoint:
            raise ValueError(
                "skip_recompute_combine skips part of the layer's recompute, and "
                "recompute_in_checkpoint=False removes that recompute altogether: set "
                "skip_recompute_combine=False (or recompute_in_checkpoint=True)")

    def _check_exchange(self):
        if self.comm_backend == "symm_mem" and self.ep_size > PEER_MAX_RANKS:
            raise ValueError(f"comm_backend='symm_mem' supports at most {PEER_MAX_RANKS} "
                             f"ranks, got ep_size={self.ep_size}: use comm_backend='all_to_all'")
        if self.num_experts % self.ep_size:
            raise ValueError(f"ep_size ({self.ep_size}) must divide num_experts "
                             f"({self.num_experts}): each rank owns num_experts/ep_size "
                             "experts; use a divisor")
        if self.comm_backend == "local" and self.ep_size != 1:
            raise ValueError(f"comm_backend='local' moves no rows between ranks, so ep_size must "
                             f"be 1 (got {self.ep_size}); use 'all_to_all', 'symm_mem' or "
                             "'deepep'")
        if self.comm_backend == "deepep":
            if self.ep_size not in DEEPEP_INTRANODE_SIZES:
                raise ValueError(f"comm_backend='deepep' supports ep_size in "
                                 f"{DEEPEP_INTRANODE_SIZES} (intranode), got {self.ep_size}: "
                                 "use one of those, or comm_backend='all_to_all'")
            if self.comm_num_sm % 2:
                raise ValueError(f"comm_num_sm must be even for DeepEP (it runs comm_num_sm/2 "
                                 f"channels), got {self.comm_num_sm}: use "
                                 f"{self.comm_num_sm + 1}")
            if (self.hidden_size * 2) % 16 or self.hidden_size > DEEPEP_MAX_HIDDEN:
                raise ValueError(
                    f"DeepEP cannot carry hidden_size={self.hidden_size}: bf16 rows must be a "
                    f"multiple of 16 bytes and hidden_size <= {DEEPEP_MAX_HIDDEN}; use "
                    "comm_backend='all_to_all'"
                )
            if self.num_experts // self.ep_size > 128:
                raise ValueError(
                    f"DeepEP supports at most 128 experts per rank, got "
                    f"{self.num_experts // self.ep_size} ({self.num_experts} over ep_size="
                    f"{self.ep_size}): raise ep_size (up to {max(DEEPEP_INTRANODE_SIZES)}) or "
                    "use comm_backend='all_to_all'")

    def _check_weighting(self):
        if self.expert_bias and self.score_apply != "post":
            raise ValueError(
                f"expert_bias needs score_apply='post', got {self.score_apply!r}: the routing "
                "weight multiplies the whole expert output, down_proj_bias included (GPT-OSS); "
                "'activation' would leave the down bias unweighted and 'pre' would weight the "
                "input instead of the output")

    def _check_overlap(self):
        if not self.overlap_weight_grad:
            return
        if self.ep_size == 1:
            raise ValueError(
                "overlap_weight_grad overlaps the experts' weight-gradient GEMMs with the "
                "backward combine between ranks; with ep_size=1 there is no combine to hide "
                "them behind: set overlap_weight_grad=False")
        if not hasattr(torch._C, "_set_sm_carveout_experimental"):
            raise ValueError(
                "overlap_weight_grad needs torch._C._set_sm_carveout_experimental to keep the "
                "communication's SMs free of GEMMs (without it the overlap is slower than "
                "serial); this torch build lacks it: upgrade torch or set "
                "overlap_weight_grad=False")

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def act_static(self) -> tuple[int, float, float]:
        """(act_id, alpha, limit) as the pure pairs and kernels take them."""
        return resolve_activation(self.activation, self.activation_alpha, self.activation_limit)
