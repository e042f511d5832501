"""MoEConfig: every option of an MoE layer, documented one by one and grouped (routing,
experts, exchange, checkpointing), validated once when built (fail closed)."""

from __future__ import annotations

import functools
import math
import re

import attrs
import torch

from .pure.activations import ACTIVATIONS, LAYOUTS, resolve_activation
from .pure.dispatch import PEER_MAX_RANKS
from .pure.router import router_validate

SCORE_APPLY = ("post", "pre", "activation")
IMPLS = ("fused", "reference")
BALANCE_SCOPES = ("micro_batch", "group")
GATE_UP_IMPLS = ("fused", "separate")
EXPERT_PRECISIONS = ("native", "fp8_rowwise")
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


# The option groups, in the order help(MoEConfig) and docs/config.md list them.
GROUPS = {
    "routing": "Routing: which experts each token chooses, and its routing weights.",
    "experts": "Experts: the expert MLP and how it is computed.",
    "exchange": "Exchange: how rows move between the ranks of an expert-parallel group "
                "(docs/exchanges.md), and how the routing weights and the combine's sums "
                "are computed.",
    "checkpointing": "Checkpointing: what the layer does inside moe_fn.checkpoint or an HF "
                     "checkpointed block.",
    "balancing": "Load balancing (docs/load_balancing.md): losses on the router logits whose "
                 "gradient the layer adds in its own backward; every coefficient 0 (off) by "
                 "default.",
}


def option(default=attrs.NOTHING, *, group: str, doc: str):
    """A documented MoEConfig field: ``group`` one of ``GROUPS``, ``doc`` what it means and
    what it takes, shown by ``help(MoEConfig)`` and ``docs/config.md``. A new option is one
    ``name: type = option(default, group=..., doc=...)`` line in its group of
    ``MoEConfig``, plus, where it needs one, a check in ``__attrs_post_init__``."""
    if group not in GROUPS:
        raise ValueError(f"group must be one of {tuple(GROUPS)}, got {group!r}")
    return attrs.field(default=default, metadata={"group": group, "doc": doc})


def _options_doc(cls) -> str:
    """The per-option part of the class docstring, grouped, from the fields' metadata."""
    lines = []
    for group, title in GROUPS.items():
        lines += ["", "    " + title, ""]
        for f in attrs.fields(cls):
            if f.metadata["group"] == group:
                default = "" if f.default is attrs.NOTHING else f" = {f.default!r}"
                lines.append(f"    ``{f.name}``{default}")
                lines += ["        " + line for line in f.metadata["doc"].splitlines()]
    return "\n".join(lines)


def _documented(cls):
    """Every option's documentation appended, grouped, to the class docstring; and a
    removed option raising ValueError naming its replacement (attrs would raise a bare
    TypeError for an unknown keyword)."""
    undocumented = [f.name for f in attrs.fields(cls)
                    if f.metadata.get("group") not in GROUPS or not f.metadata.get("doc")]
    if undocumented:
        raise TypeError(f"MoEConfig options without a group and documentation (use "
                        f"option()): {undocumented}")
    cls.__doc__ = cls.__doc__.rstrip() + "\n" + _options_doc(cls) + "\n    "
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


@_documented
@attrs.frozen(kw_only=True)
class MoEConfig:
    """Options of one MoE layer. Built once; an invalid option or combination raises
    ``ValueError`` naming the fix, and a removed option raises ``ValueError`` naming what
    replaced it. Every default is the fastest correct choice measured (bench/RESULTS.md);
    slower paths are options, kept as references or for what they trade (memory, a
    contract)."""

    # ---- routing ---------------------------------------------------------------------------
    num_experts: int = option(group="routing", doc="E, the routed experts.")
    top_k: int = option(group="routing", doc="k, the experts each token is sent to.")
    score_func: str = option(
        "softmax", group="routing",
        doc="How router logits become scores: 'softmax', 'sigmoid' or 'softmax_topk'\n"
            "(a softmax over the chosen experts' logits).")
    norm_topk_prob: bool = option(
        True, group="routing", doc="Normalise the chosen experts' weights to sum to 1.")
    n_group: int = option(
        1, group="routing",
        doc="Expert groups (DeepSeek-V3): the experts split into n_group groups, of which\n"
            "each token chooses its experts from topk_group.")
    topk_group: int = option(1, group="routing",
                             doc="Groups each token may choose its experts from.")
    group_score: str = option(
        "top2_sum", group="routing",
        doc="How a group is scored for that choice: 'top2_sum' (its two best scores) or\n"
            "'max'.")
    score_correction_bias: bool = option(
        False, group="routing",
        doc="A (E,) float32 buffer added to the scores for the choice only, not the\n"
            "weights (DeepSeek-V3's load-balancing bias).")
    routed_scaling_factor: float = option(
        1.0, group="routing", doc="A positive, finite factor scaling every routing weight.")
    router_bias: bool = option(
        False, group="routing", doc="A learned (E,) bias on the router logits (GPT-OSS).")
    score_apply: str = option(
        "post", group="routing",
        doc="Where the routing weights apply: 'post' (on the experts' outputs), 'pre' (on\n"
            "their input rows, Llama-4) or 'activation' (folded into the activation).")
    # ---- experts ---------------------------------------------------------------------------
    hidden_size: int = option(group="experts", doc="H, the width of a token's row.")
    intermediate_size: int = option(
        group="experts", doc="I, each expert's hidden width (gate_up_proj is (E, 2I, H)).")
    activation: str = option(
        "swiglu", group="experts", doc=f"The gated activation, one of {ACTIVATIONS}.")
    activation_alpha: float | None = option(
        None, group="experts",
        doc="The activation's alpha (swiglu_oai's sigmoid scale); None: its default.")
    activation_limit: float | None = option(
        None, group="experts",
        doc="The activation's clamp limit (swiglu_clamped, swiglu_oai; positive); None:\n"
            "its default.")
    gate_up_layout: str = option(
        "halves", group="experts",
        doc=f"How gate_up_proj packs gate and up, one of {LAYOUTS}: 'halves' (HF's\n"
            "[gate; up]) or 'interleaved' (GPT-OSS's alternating rows).")
    gate_up_impl: str = option(
        "fused", group="experts",
        doc="'fused': one grouped GEMM over the packed (E, 2I, H) weight and an activation\n"
            "kernel reading both halves in place; 'separate': two GEMMs (slower).")
    expert_bias: bool = option(
        False, group="experts",
        doc="Biases inside each expert (GPT-OSS): gate_up_proj_bias (E, 2I) after gate+up\n"
            "and down_proj_bias (E, H) after down. Needs score_apply='post' (the weight\n"
            "scales the whole expert output, down bias included).")
    expert_precision: str = option(
        "native", group="experts",
        doc="How the expert GEMMs compute. 'native': in the layer's dtype. 'fp8_rowwise':\n"
            "gate+up and down, forward, and their input gradients in float8 e4m3 with\n"
            "per-row power-of-two scales from the current values (rows per row, weights per\n"
            "output channel, quantised once per change of the weights), the quantisation\n"
            "fused into the dispatch's gather and the activation's passes; weight gradients\n"
            "in the layer's dtype (docs/precision_compile_graphs.md). Needs\n"
            "gate_up_impl='fused', score_apply 'post' or 'activation', hidden_size and\n"
            "intermediate_size multiples of 16, torch._scaled_grouped_mm; on CUDA a bfloat16\n"
            "layer on a GPU of compute capability 9.0 or later; on the CPU (bfloat16 or\n"
            "float32) the same numerics, emulated.")
    # ---- exchange --------------------------------------------------------------------------
    comm_backend: str = option(
        "local", group="exchange",
        doc=f"The exchange, one of {COMM_BACKENDS} (docs/exchanges.md). 'local': one rank.\n"
            "'all_to_all': one row per (token, expert) over all_to_all_single (NCCL or\n"
            "gloo; any ranks, across hosts). 'symm_mem': tokens read once per rank from\n"
            "torch symmetric memory over NVLink, float32 partial sums on the expert side\n"
            f"(CUDA GPUs of one host, at most {PEER_MAX_RANKS} ranks; over gloo a gathering\n"
            "stand-in). 'deepep': DeepEP's intranode Buffer (CUDA, bf16, ep_size 2/4/8;\n"
            "DeepEP built from source).")
    ep_size: int = option(
        1, group="exchange",
        doc="Ranks of the expert-parallel group; rank r owns experts\n"
            "[r*E/ep_size, (r+1)*E/ep_size). Must divide num_experts.")
    impl: str = option(
        "fused", group="exchange",
        doc="How the routing weights are applied and the combine's sums computed.\n"
            "'fused' (the fastest for every exchange): Triton passes; with\n"
            "score_apply='post' the weights enter the combine's own sum where the\n"
            "exchange sums a token's rows (at home over local and all_to_all, on the\n"
            "expert side over symm_mem and deepep), so no weighting pass runs.\n"
            "'reference': plain PyTorch (rows * w, then a gather and a sum); slower, the\n"
            "oracle of 'fused'.")
    comm_num_sm: int = option(
        20, group="exchange",
        doc="SMs the communication takes: DeepEP's kernels (even), the symm_mem pulls of\n"
            "an overlapped backward, and the SMs the overlap withholds from the\n"
            "weight-gradient GEMMs. At EP2 the overlap hid the most of the backward combine\n"
            "at 12 over deepep and symm_mem and at 20 over all_to_all (bench/RESULTS.md,\n"
            "weight-gradient overlap).")
    overlap_weight_grad: bool = option(
        False, group="exchange",
        doc="Run the experts' weight-gradient GEMMs beside the backward combine of dX\n"
            "(expert parallelism only; needs torch's SM carveout). Over all_to_all with\n"
            "NCCL, cap NCCL's CTAs at comm_num_sm (ProcessGroupNCCL.Options), as the\n"
            "measurements did.")
    # ---- checkpointing ---------------------------------------------------------------------
    skip_recompute_combine: bool = option(
        False, group="checkpointing",
        doc="In a reentrant checkpoint's recompute, record the combine (and post-expert\n"
            "weighting) instead of running it; the output is a NaN sentinel. Correct only\n"
            "where the MoE output feeds nothing but the block's residual add, a contract\n"
            "checked in each recompute (docs/checkpointing.md), hence off by default.")
    recompute_in_checkpoint: bool = option(
        True, group="checkpointing",
        doc="False: inside a checkpoint the layer keeps its activations from the forward\n"
            "and is not recomputed (faster, at the memory of an unchecked MoE layer).")
    # ---- load balancing --------------------------------------------------------------------
    aux_loss_coef: float = option(
        0.0, group="balancing",
        doc="Switch/GShard loss E * sum_e f_e * P_e (Megatron-Core's normalisation: f_e =\n"
            "c_e / (k T), the share of the top-k counts, P_e the mean router probability;\n"
            "1 when balanced).")
    aux_loss_scope: str = option(
        "micro_batch", group="balancing",
        doc="Whose counts f_e (and T) are: 'micro_batch' (this call's tokens) or 'group'\n"
            "(the whole batch of MoELayer's balance_group, one all-reduce of E counts per\n"
            "call).")
    seq_aux_loss_coef: float = option(
        0.0, group="balancing",
        doc="Sequence-level loss (DeepSeek-V2/V3): the Switch loss of each sequence,\n"
            "averaged over the sequences ((B, S, H): B sequences; (T, H): one, or\n"
            "T/seq_len).")
    z_loss_coef: float = option(
        0.0, group="balancing",
        doc="Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2.")

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
        _one_of("expert_precision", self.expert_precision, EXPERT_PRECISIONS)
        _one_of("comm_backend", self.comm_backend, COMM_BACKENDS)
        for name in ("score_correction_bias", "router_bias", "expert_bias",
                     "overlap_weight_grad", "skip_recompute_combine", "recompute_in_checkpoint"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self._check_exchange()
        self._check_weighting()
        self._check_precision()
        self._check_overlap()
        self._check_balance()
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

    def _check_precision(self):
        if self.expert_precision != "fp8_rowwise":
            return
        fix = "or set expert_precision='native'"
        if not hasattr(torch, "_scaled_grouped_mm"):
            raise ValueError("expert_precision='fp8_rowwise' needs torch._scaled_grouped_mm "
                             f"(torch 2.8 or later with CUDA): upgrade torch, {fix}")
        if self.gate_up_impl != "fused":
            raise ValueError("expert_precision='fp8_rowwise' computes gate+up as one FP8 GEMM "
                             "over the packed weight: set gate_up_impl='fused', " + fix)
        if self.score_apply == "pre":
            raise ValueError("expert_precision='fp8_rowwise' quantises the rows as the dispatch "
                             "moves them, before score_apply='pre' could weight them: use "
                             "score_apply 'post' or 'activation', " + fix)
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) % 16:
                raise ValueError(f"expert_precision='fp8_rowwise' needs {name} to be a multiple "
                                 f"of 16 (the FP8 GEMMs' rows are 16-byte aligned), got "
                                 f"{getattr(self, name)}: pad it, " + fix)

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

    def _check_balance(self):
        for name in ("aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0 (0 leaves the loss "
                                 f"off), got {v!r}")
        _one_of("aux_loss_scope", self.aux_loss_scope, BALANCE_SCOPES)
        if self.aux_loss_scope == "group" and not self.aux_loss_coef:
            raise ValueError("aux_loss_scope='group' counts the Switch loss's experts over a "
                             "process group, but aux_loss_coef=0 leaves that loss off: set "
                             "aux_loss_coef > 0, or leave aux_loss_scope='micro_batch'")

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def act_static(self) -> tuple[int, float, float]:
        """(act_id, alpha, limit) as the pure pairs and kernels take them."""
        return resolve_activation(self.activation, self.activation_alpha, self.activation_limit)


def options_markdown() -> str:
    """Every MoEConfig option, grouped, as the Markdown of ``docs/config.md``."""
    out = ["# MoEConfig options", "",
           "Generated from the fields' documentation in `moe_fn/config.py` (`help(moe_fn."
           "MoEConfig)` shows the same); regenerate with `python -c \"import moe_fn.config "
           "as c; print(c.options_markdown(), end='')\" > docs/config.md`.", ""]
    for group, title in GROUPS.items():
        out += [f"## {group}", "", title, "", "| option | default | meaning |",
                "|---|---|---|"]
        for f in attrs.fields(MoEConfig):
            if f.metadata["group"] == group:
                default = "required" if f.default is attrs.NOTHING else f"`{f.default!r}`"
                doc = " ".join(f.metadata["doc"].split()).replace("|", "\\|")
                out.append(f"| `{f.name}` | {default} | {doc} |")
        out.append("")
    out += ["## removed", "", "Passing one raises `ValueError` naming its replacement:", ""]
    out += [f"- `{name}`: use {repl}" for name, repl in REMOVED_OPTIONS.items()]
    out += [f"- `{name}={value!r}`: use {repl}" for name, values in REMOVED_VALUES.items()
            for value, repl in values.items()]
    return "\n".join(out) + "\n"
