"""MoELayer: route, dispatch, experts, combine — with expert parallelism over an Exchange."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from . import functional, kernels
from . import layer_checks as checks
from ._checks import FLOAT_DTYPES, check_fp8_call, debug_checks
from .autograd.balance import BalanceGrad
from .autograd.experts import FP8_IMPL, Experts, ExpertsFp8
from .autograd.fp8_cache import Fp8WeightCache
from .autograd.kept import ReplayKept
from .autograd.routing import Combine, Dispatch, Router, SkippedCombine
from .autograd.slot import WeightGradSlot
from .balance import BalanceLosses, LayerBalance
from .comm.base import Exchange, Summation
from .comm.carveout import sm_count
from .comm.groups import HoldsProcessGroups
from .comm.sorted_rows import AllToAllExchange, LocalExchange
from .config import MoEConfig
from .placement import (
    EXPERT_NAMES,
    GuardedExperts,
    ep_group_and_mesh,
    experts_module_setup,
    local,
    prepare_fsdp_experts,
    register_expert_state_hooks,
    shard_experts,
)
from .pure.activations import resolve_layout
from .pure.experts_fp8 import quantize_expert_weights
from .records import RoutePlan
from .replay import KeptActivations, current_region
from .resources import RESOURCES
from .skip_check import SkipContractError


def make_exchange(config: MoEConfig, process_group=None, resources=RESOURCES, *,
                  what: str = "process group") -> Exchange:
    """The exchange a config asks for, drawing on ``resources`` (the process's, by
    default); group size is checked before any collective runs (``what`` names the group:
    "process group", or "mesh" for a layer built on one)."""
    if config.comm_backend == "local":
        if process_group is not None and dist.get_world_size(process_group) != 1:
            n = dist.get_world_size(process_group)
            if config.num_experts % n:
                raise ValueError(_indivisible(what, n, config))
            raise ValueError(f"comm_backend='local' with a process group of {n} ranks: for "
                             f"expert parallelism over it set ep_size={n} and comm_backend="
                             "'all_to_all', 'symm_mem' or 'deepep' (moe_fn.hf.convert(model, "
                             "ep_size="
                             f"{n}, process_group=...) picks 'all_to_all'), or pass no group")
        return LocalExchange(num_experts=config.num_experts, resources=resources,
                             fused_sums=config.impl == "fused")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"comm_backend={config.comm_backend!r} needs torch.distributed "
                           "initialised (dist.init_process_group) before the layer is built")
    size = dist.get_world_size(process_group)
    if size != config.ep_size:
        if config.num_experts % size:
            raise ValueError(_indivisible(what, size, config))
        raise ValueError(f"the {what} has {size} ranks but ep_size is "
                         f"{config.ep_size}: pass a {what} of {config.ep_size} ranks, or set "
                         f"ep_size={size}")
    if config.comm_backend == "symm_mem":
        from .comm.symm_mem import SymmMemExchange
        return SymmMemExchange(num_experts=config.num_experts, group=process_group,
                               resources=resources, num_sms=config.comm_num_sm)
    if config.comm_backend == "all_to_all":
        return AllToAllExchange(num_experts=config.num_experts, group=process_group,
                                resources=resources,
                                fused_sums=config.impl == "fused")
    from .comm.deepep import DeepEPExchange
    return DeepEPExchange(num_experts=config.num_experts, group=process_group,
                          resources=resources, hidden_size=config.hidden_size,
                          num_sms=config.comm_num_sm)


def _indivisible(what: str, size: int, config: MoEConfig) -> str:
    return (f"the {what} has {size} ranks, which do not divide num_experts="
            f"{config.num_experts}: each rank owns num_experts/ep_size experts; use a {what} "
            f"whose size divides {config.num_experts} (and ep_size equal to it)")


def make_route_plan(topk_idx: torch.Tensor, num_experts: int) -> RoutePlan:
    topk_idx = topk_idx.contiguous()  # DeepEP reads it as a dense (T, k) array
    with torch.no_grad():
        counts, offs, perm, inv_perm, tokens = kernels.layout_with_tokens(topk_idx, num_experts)
    return RoutePlan(topk_idx=topk_idx, counts=counts, perm=perm, inv_perm=inv_perm, offs=offs,
                     token_of_sorted=tokens, num_experts=num_experts, top_k=topk_idx.shape[1])


class MoERouter(nn.Module):
    def __init__(self, config: MoEConfig, *, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size,
                                               device=device, dtype=dtype))
        if config.score_correction_bias:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(config.num_experts, device=device,
                                             dtype=torch.float32))
            self.register_load_state_dict_pre_hook(checks.RefuseNonfiniteBias(
                "e_score_correction_bias"))
        else:
            self.e_score_correction_bias = None
        if config.router_bias:
            self.bias = nn.Parameter(torch.empty(config.num_experts, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)


class RunWithExperts:
    """What a MoELayer hands the module holding its expert parameters to call: the layer's
    forward, run as that module's forward so that the module's hooks (FSDP2's all-gather
    before it and the gradients' reduce-scatter after its backward) surround everything that
    reads the expert parameters."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class MoEExperts(GuardedExperts, nn.Module):
    """This rank's experts in Hugging Face's layout: ``gate_up_proj (E_local, 2I, H)``,
    ``down_proj (E_local, H, I)``; with ``config.expert_bias`` also
    ``gate_up_proj_bias (E_local, 2I)`` (packed as the weight) and
    ``down_proj_bias (E_local, H)``. Built on a DeviceMesh with ``ep_size > 1`` each is a
    DTensor ``Shard(0)`` over it, of the whole ``(E, ...)`` shape, whose local tensor is
    that slice (``moe_fn.placement``).

    The MoELayer runs its forward as this module's (``experts(RunWithExperts(fn), ...)``),
    so that module hooks on it (FSDP2's, where the experts are a unit of their own) wrap
    every use of the parameters.

    MoELayer reads these four attributes on every call and passes them to the experts'
    autograd shell as they are, so a subclass (or ``moe_fn.hf``'s view) may serve
    views of other storage, e.g. GPT-OSS's ``(E, H, 2I)`` parameter as ``.transpose(1, 2)``:
    no copy is made and the gradients reach the viewed parameter."""

    def __init__(self, config: MoEConfig, *, device=None, dtype=None, mesh=None):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        shapes = {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}
        if config.expert_bias:
            shapes.update(gate_up_proj_bias=(e, 2 * i), down_proj_bias=(e, h))
        for name in EXPERT_NAMES:
            if name not in shapes:
                self.register_parameter(name, None)
                continue
            t = torch.empty(shapes[name], device=device, dtype=dtype)
            if mesh is not None and config.ep_size > 1:
                t = shard_experts(t, mesh, config.num_experts)
            setattr(self, name, nn.Parameter(t))
        experts_module_setup(self, config.ep_size)

    def forward(self, run: RunWithExperts, *args, **kwargs):
        """``run(*args, **kwargs)``: the MoELayer's forward with these experts."""
        if not isinstance(run, RunWithExperts):
            raise TypeError("MoEExperts is called by its MoELayer only (it holds the expert "
                            "parameters; call the layer)")
        prepare_fsdp_experts(self, self.__dict__.get("_moe_fn_ep_size", 1))
        return run(*args, **kwargs)


class MoELayer(HoldsProcessGroups, nn.Module):
    """A Mixture-of-Experts layer mapping ``(..., H)`` to ``(..., H)``.

    Rank r of the expert-parallel group (``process_group``: a ProcessGroup, or a 1-D
    DeviceMesh such as ``mesh["ep"]``; default the world group when ``config.ep_size > 1``)
    owns the contiguous experts ``r*E/ep ... (r+1)*E/ep - 1``. On a mesh the expert
    parameters are DTensors ``Shard(0)`` over it (FSDP2, distributed checkpoints and
    ``moe_fn.parallel`` read their placement); on a process group they are plain tensors
    holding the slice, and ``state_dict()`` gives them as DTensors over the group
    (``moe_fn.placement``).
    Routing weights are applied where ``config.score_apply`` says; for ``"post"`` with
    ``impl="fused"`` they enter the combine's own sum where its exchange sums a token's
    rows (``Exchange.summation``): at home over the local and all_to_all exchanges (one
    fused pass, nothing extra sent), on the expert side over symm_mem and DeepEP; with
    ``impl="reference"`` they scale the expert rows before a plain-sum combine.

    A layer pickles and ``torch.save``s whole, and copies share its process groups; one
    holding a group other than the default one is refused by pickle (save its
    ``state_dict()``), and one of the default group loads on the rank that saved it, in a
    job of the same size (``moe_fn.comm.groups``).
    """

    # Within a forward under torch.autocast: the dtype the layer computes in.
    _autocast_to: torch.dtype | None = None

    def __init__(self, config: MoEConfig, process_group=None, *, balance_group=None,
                 device=None, dtype=None):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dtype}")
        group, mesh = ep_group_and_mesh(process_group)
        if mesh is not None and device is not None and \
                torch.device(device).type not in (mesh.device_type, "meta"):
            raise ValueError(f"the layer's device {device} is not its mesh's device type "
                             f"{mesh.device_type!r}: build the mesh and the layer on one "
                             "device type")
        self.config = config
        self.process_group = group
        # The expert-parallel mesh the layer was built on (None: a process group); its
        # expert parameters are DTensors over it where ep_size > 1.
        self.ep_mesh = mesh
        # The load-balancing losses' state and, with aux_loss_scope="group", the group
        # whose whole batch their counts cover.
        self.balance = LayerBalance(config, checks.balance_group(config, balance_group))
        self.exchange = make_exchange(config, group, what="process group" if mesh is None
                                      else "mesh")
        self.router = MoERouter(config, device=device, dtype=dtype)
        self.experts = MoEExperts(config, device=device, dtype=dtype, mesh=mesh)
        self.reset_parameters()
        if config.ep_size > 1:
            register_expert_state_hooks(self, (f"experts.{n}" for n in EXPERT_NAMES[
                :4 if config.expert_bias else 2]))
        # What the parameters and biases must be (the config is frozen: computed once).
        self._param_shapes = checks.expected_param_shapes(config)
        self._bias_spec = checks.expected_biases(config)
        # The experts' static arguments, resolved once: the layer calls their shell directly
        # (functional.experts would validate on every call what the config and the layer's
        # own checks already have).
        self._experts_static = (*config.act_static, resolve_layout(config.gate_up_layout),
                                config.gate_up_impl == "fused")
        # The expert weights as the FP8 GEMMs read them, quantised once per change.
        self.fp8_weights = Fp8WeightCache()
        # The agreement stamp per (dtype, device) (checks.agreement), and the (dtype,
        # device) whose comm_num_sm (and FP8 support) was last checked.
        self._stamps = {}
        self._sms_checked_on = self._fp8_checked_on = None
        # Said once per layer: a non-reentrant recompute replays but cannot skip.
        self.skip_mode_warned = False

    @property
    def ep_rank(self) -> int:
        return self.exchange.rank

    @property
    def balance_loss(self) -> torch.Tensor | None:
        """The config's balancing losses times their coefficients, summed, in the last
        forward that trained (a detached 0-dim tensor, float32; float64 for a float64
        layer; None before one, or with every coefficient 0). Their gradient is added in
        the layer's backward: do not add this to the loss."""
        return self.balance.loss

    @property
    def balance_losses(self) -> BalanceLosses | None:
        """Each balancing loss of that forward, without its coefficient."""
        return self.balance.losses

    def extra_balance_terms(self) -> tuple:
        """Further balancing terms for this call (objects with ``grad(logits) ->
        d_logits``), whose gradient the layer adds in its backward as its own losses':
        none here (``moe_fn.hf``'s layer adds transformers' loss under reentrant
        checkpointing)."""
        return ()

    def reset_parameters(self, std: float = 0.02) -> None:
        with torch.no_grad():
            # Each rank draws its own experts (a DTensor's local tensor), as on a group.
            for p in (self.router.weight, self.experts.gate_up_proj, self.experts.down_proj):
                local(p).normal_(0.0, std)
            for p in (self.router.bias, self.experts.gate_up_proj_bias,
                      self.experts.down_proj_bias, self.router.e_score_correction_bias):
                if p is not None:
                    local(p).zero_()

    def router_params(self, x2: torch.Tensor) -> tuple:
        """``(weight, bias)`` of the router's linear as ``route`` computes the logits of
        ``x2`` with them (under ``torch.autocast`` cast to its input's dtype)."""
        r = self.router
        if self._autocast_to is None:
            return r.weight, r.bias
        return _cast(r.weight, x2.dtype), _cast(r.bias, x2.dtype)

    def route(self, x2: torch.Tensor, replay_idx=None):
        """Router logits (T, E) and the differentiable top-k weights with their indices.

        ``replay_idx`` (a recorded route) skips the choice; the weights are recomputed."""
        c = self.config
        weight, bias = self.router_params(x2)
        if debug_checks() and self.router.e_score_correction_bias is not None:
            checks.check_score_correction_bias(self.router.e_score_correction_bias,
                                        "router.e_score_correction_bias")
        return Router.apply(x2, weight, bias, self.router.e_score_correction_bias, c.top_k,
                            c.score_func, c.norm_topk_prob, c.n_group, c.topk_group,
                            c.group_score, float(c.routed_scaling_factor), replay_idx)

    def _weight_rows(self, rows, row_w):
        if self.config.impl == "fused":
            return functional.row_weight(rows, row_w)
        # Eager, as Hugging Face does it: the weights cast to the rows' dtype.
        return rows * row_w.to(rows.dtype)[:, None]

    def expert_weights(self) -> tuple:
        """``(gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias)`` as the experts
        compute with them (biases None without ``config.expert_bias``): the parameters, or
        under ``torch.autocast`` their casts to its dtype (once per forward, so that every
        use shares one copy and its gradient). The FP8 experts quantise the parameters
        themselves (a float32 master weight directly, never a cast that changes every
        call), and cast the biases where they add them."""
        ex = self.experts
        biases = ((local(ex.gate_up_proj_bias), local(ex.down_proj_bias))
                  if self.config.expert_bias else (None, None))
        gate_up, down = local(ex.gate_up_proj), local(ex.down_proj)
        if self.config.expert_precision == "fp8_rowwise":
            return (gate_up, down, *biases)
        return tuple(_cast(t, self._autocast_to) for t in (gate_up, down, *biases))

    def expert_compute(self, rows, row_w, offs, *, post_weighting: bool = True, slot=None,
                       weights=None, x_rows=None):
        """The experts on their rows; ``weights`` is ``expert_weights()`` (read when
        None). With ``expert_precision='fp8_rowwise'``, ``x_rows`` holds the rows quantised
        (the FP8 dispatch's ``Fp8Rows``; None: quantised here) and ``rows`` carries their
        gradient."""
        c = self.config
        if c.score_apply == "pre":
            rows = self._weight_rows(rows, row_w)
        gate_up, down, gate_up_bias, down_bias = weights or self.expert_weights()
        if c.expert_precision == "fp8_rowwise":
            if gate_up.is_cuda and torch.cuda.is_current_stream_capturing():
                # A CUDA graph replays without the host: the cache's check would run once,
                # at capture, and every replay would read those weights however they
                # changed since. Quantised inside the graph, every replay reads them anew.
                quantized = quantize_expert_weights(gate_up, down, FP8_IMPL)
            else:
                quantized = self.fp8_weights.get(gate_up, down, FP8_IMPL)
            y = ExpertsFp8.apply(rows, x_rows, gate_up, down, offs,
                                 row_w if c.score_apply == "activation" else None,
                                 gate_up_bias, down_bias, quantized,
                                 *self._experts_static[:4], slot)
            if c.score_apply == "post" and post_weighting:
                y = self._weight_rows(y, row_w)
            return y
        # functional.experts' contract; its checks are the config's and check_parameters'.
        y = Experts.apply(rows, gate_up, down, offs,
                          row_w if c.score_apply == "activation" else None, gate_up_bias,
                          down_bias, *self._experts_static, slot)
        if c.score_apply == "post" and post_weighting:
            y = self._weight_rows(y, row_w)
        return y

    def router_input_dtype(self, x_dtype: torch.dtype) -> torch.dtype:
        """The dtype the router's linear gets its input in: ``x``'s here (subclasses, such as
        the Hugging Face conversion's, may cast it, e.g. to a float32 router)."""
        return x_dtype
    def _weight_placement(self, skip: bool = False) -> tuple[bool, bool]:
        """``(home_w, fold_w)``: whether post-expert routing weights enter the combine's sum
        at home, or the expert side's per-token sum, instead of a weighting pass."""
        c = self.config
        post = c.score_apply == "post" and not skip and c.impl == "fused"
        # The weights enter the combine's own sum: at home, where rows come home one by one
        # (they need not travel, and no weighting pass runs; eagerly a weighted sum at home
        # costs more float32 passes than weighting on the expert side, so the reference
        # weights the rows), or in the expert side's per-token sum where the exchange sums
        # there (its weights ride with the dispatch's rows). The skipped combine keeps the
        # expert-side weighting: its backward needs the rows there.
        summation = self.exchange.summation
        home_w = post and summation is Summation.HOME
        fold_w = post and summation is Summation.EXPERTS
        return home_w, fold_w

    def _forward_routed(self, x2, region, seq_len=None):
        """Route, dispatch, experts, combine: ``(out (T, H), logits (T, E))``. In a
        checkpoint region the forward records its route and the recompute replays it."""
        c = self.config
        entry = region.consume(self) if region is not None and region.replaying else None
        logits, idx, w = self.route(x2, None if entry is None else entry.plan.topk_idx)
        # A forward that trains: autograd on, or a checkpoint's first forward called with
        # it (a reentrant one runs without); never a recompute (entry given).
        trains = entry is None and (torch.is_grad_enabled()
                                    or (region is not None and region.grad_at_call))
        if entry is not None:
            terms = entry.balance
        elif trains:
            terms = self.balance.terms(logits, seq_len or x2.shape[0],
                                       self.extra_balance_terms())
        else:
            terms = None
        if terms is not None and torch.is_grad_enabled():
            w = BalanceGrad.apply(w, logits, terms, self.balance)
        overlap = ()
        slot = None
        weights = self.expert_weights()
        if c.overlap_weight_grad:
            slot = WeightGradSlot()
            overlap = (*weights[:2], slot, c.comm_num_sm, *weights[2:])
        skip = entry is not None and region.reentrant and c.skip_recompute_combine
        fp8 = c.expert_precision == "fp8_rowwise"
        if (entry is not None and c.skip_recompute_combine and not region.reentrant
                and not self.skip_mode_warned):
            self.skip_mode_warned = True
            warnings.warn("skip_recompute_combine=True does not apply under a non-reentrant "
                          "checkpoint (replay still runs): checkpoint reentrantly, as "
                          "moe_fn.checkpoint(fn, *args) does by default", stacklevel=2)
        # After a skipped combine in this recompute (several layers in one region), this
        # layer's input must not come from it: the skip serves only the residual add.
        watch = region.watch if entry is not None else None
        if watch is not None:
            problem = watch.input_problem(x2)
            if problem is not None:
                raise SkipContractError(
                    "skip_recompute_combine=True: in this checkpoint's recompute, an MoE "
                    f"layer's input after an earlier MoE layer's skipped output is {problem} "
                    "(the skip serves only the residual add that ends the checkpointed "
                    "block). Checkpoint one MoE layer per region, or set "
                    "skip_recompute_combine=False (replay alone handles several per region)")
        home_w, fold_w = self._weight_placement(skip)
        sent_w = None if home_w else w
        if entry is None:
            plan = make_route_plan(idx, c.num_experts)
            layout = self.exchange.layout(plan, **checks.agreement(self, x2))
            rows, row_w, handle, x_rows = Dispatch.apply(x2, sent_w, self.exchange, layout,
                                                         False, fp8, *overlap)
            if trains:
                self.balance.count(plan.counts)
            if region is not None:
                region.record(self, plan, handle, balance=terms)
        else:
            rows, row_w, handle, x_rows = Dispatch.apply(x2, sent_w, self.exchange,
                                                         entry.handle, True, fp8, *overlap)
        y = self.expert_compute(rows, row_w, handle.local_offs,
                                post_weighting=not (skip or home_w or fold_w), slot=slot,
                                weights=weights, x_rows=x_rows)
        if skip:
            out = SkippedCombine.apply(y, row_w if c.score_apply == "post" else None,
                                       self.exchange, handle, c.impl == "fused")
            region.note_skip(out)
        else:
            # Without a backward to come (no grad mode: a reentrant checkpoint's first
            # forward, inference) the home-weighted combine keeps nothing.
            needs_grad = torch.is_grad_enabled() and (y.requires_grad or w.requires_grad)
            out = Combine.apply(y, self.exchange, handle,
                                w if home_w else row_w if fold_w else None, needs_grad)
        if watch is not None:
            watch.trust_layer((out, logits), x2)
        return out, logits

    def _forward_kept(self, x2, region, seq_len=None):
        """``recompute_in_checkpoint=False`` inside a checkpoint region: the forward keeps
        the layer's activations and the recompute returns its outputs without running it."""
        if region.replaying:
            kept = region.consume(self).kept
            if kept.x_leaf is not None:
                anchor = torch.empty(0, device=x2.device, requires_grad=kept.out.requires_grad
                                     or kept.logits.requires_grad)
                out, logits = ReplayKept.apply(x2, anchor, kept)
                if region.watch is not None:
                    # The forward's outputs, whatever the recompute's input holds.
                    region.watch.trust_layer((out, logits), x2)
                return out, logits
            # Non-reentrant: the forward's own graph serves the backward; the recompute
            # needs only the values (as leaves that require grad where the originals did,
            # so the ops after the layer save what they saved the first time).
            return tuple(t.clone().requires_grad_(t.requires_grad) for t in
                         (kept.out, kept.logits))
        if not region.grad_at_call:
            # Called without autograd (no_grad, inference_mode): no backward, so nothing to
            # keep for it; the plain forward.
            return self._forward_routed(x2, None, seq_len)
        if region.reentrant:
            # The forward runs without autograd: build the layer's graph from a leaf copy of
            # its input, which the recompute's backward runs. The leaf always requires grad:
            # whether the input will is only known in the recompute.
            with torch.enable_grad():
                x_leaf = x2.detach().requires_grad_()
                out, logits = self._forward_routed(x_leaf, None, seq_len)
            region.record(self, kept=KeptActivations(x_leaf=x_leaf, out=out, logits=logits))
            return out.detach(), logits.detach()
        # Non-reentrant: the checkpoint's hooks would discard what autograd saves inside
        # the layer; identity hooks keep it.
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            out, logits = self._forward_routed(x2, None, seq_len)
        kept = KeptActivations(x_leaf=None, out=out.detach().requires_grad_(out.requires_grad),
                               logits=logits.detach().requires_grad_(logits.requires_grad))
        region.record(self, kept=kept)
        return out, logits

    # Under torch.compile the layer runs eagerly (a graph break at its call) and the code
    # around it compiles: its host-synchronised layouts, exchanges, records and checkpoint
    # regions are not traceable, and its hot paths are fused Triton kernels already.
    @torch.compiler.disable(reason="moe_fn.MoELayer runs eagerly under torch.compile (a graph "
                            "break at its call): compile without fullgraph=True")
    def forward(self, x: torch.Tensor, return_router_logits: bool = False, *,
                seq_len: int | None = None):
        """Route each token of ``x`` to its ``top_k`` experts and return the weighted sum
        of their outputs.

        Args:
            x: ``(..., hidden_size)``, float16, bfloat16, float32 or float64, on the
                layer's device and in its parameters' dtype. Every leading dimension is a
                token dimension: ``T`` is their product. Under ``torch.autocast`` a float32
                layer computes in autocast's dtype (``x`` float32 or already in it).
            return_router_logits: also return the router's logits.
            seq_len: only with ``seq_aux_loss_coef``: for a ``(T, H)`` input, the tokens
                are ``T / seq_len`` consecutive sequences (a flattened batch-first
                ``(B, S, H)``); without it they are one sequence. An input of three or more
                dimensions ``(..., S, H)`` holds sequences of ``S`` tokens.

        Returns:
            ``out``, with ``x``'s shape and dtype (autocast's dtype under autocast); with
            ``return_router_logits``, ``(out, router_logits)``, the logits ``(T,
            num_experts)`` flattened over the token dimensions as Hugging Face's routers
            return them, in the router's compute dtype (``x``'s here).

        With ``ep_size > 1`` every rank of the group must call the layer in the same
        order with the same config and dtype (its exchange is collective; the first call
        per dtype checks that they agree). Inside ``moe_fn.checkpoint`` or a converted
        model's HF checkpointing, the recompute replays the forward's routing.

        Raises:
            TypeError: ``x`` is not a tensor or not one of those dtypes;
                ``return_router_logits`` is not a bool; a parameter's dtype differs from
                ``x``'s (outside autocast).
            ValueError: ``x`` is 0-dimensional, its last dimension is not
                ``hidden_size`` or it is on the meta device; a parameter's shape or device
                does not match the config or ``x``; a float16 ``x`` with a
                ``routed_scaling_factor`` outside float16's range; the expert-parallel
                ranks disagree on config or dtype; ``comm_num_sm`` leaves the GPU no SMs.
            RuntimeError: CUDA graph capture of a layer whose exchange is not ``local``,
                or inside a checkpoint region.
        """
        c = self.config
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not isinstance(return_router_logits, bool):
            raise TypeError(f"return_router_logits must be a bool, got "
                            f"{type(return_router_logits).__name__}")
        if x.dtype not in FLOAT_DTYPES:  # float8 too: the experts' kernels take none
            raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"x must be (..., hidden_size={c.hidden_size}), got shape "
                             f"{tuple(x.shape)}")
        if x.is_meta:
            raise ValueError(checks.META_DEVICE)
        seq_len = checks.sequence_length(x, seq_len, c)
        # The rest runs as the forward of the module holding the expert parameters, inside
        # its hooks (FSDP2 all-gathers them before, and reduce-scatters their gradients
        # after the backward of, everything that reads them).
        return self.experts(RunWithExperts(self._forward_checked), x, return_router_logits,
                            seq_len)

    def _forward_checked(self, x, return_router_logits, seq_len):
        amp = checks.autocast_dtype(x)
        checks.check_parameters(self, x, amp)
        if amp is not None:
            # Under torch.autocast the layer runs as one in autocast's dtype: x and the
            # parameters cast to it (differentiably: float32 gradients reach float32
            # parameters), autocast off inside, where every op already has one dtype.
            with torch.autocast(x.device.type, enabled=False):
                self._autocast_to = amp
                try:
                    return self._forward(x.to(amp), return_router_logits, seq_len)
                finally:
                    self._autocast_to = None
        return self._forward(x, return_router_logits, seq_len)

    def _forward(self, x: torch.Tensor, return_router_logits: bool, seq_len=None):
        c = self.config
        if x.dtype == torch.float16:
            checks.check_float16_scale(c.routed_scaling_factor)
        shape = x.shape
        x2 = x.reshape(-1, c.hidden_size)
        region = current_region()
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            checks.check_capturable(self.exchange, region)
        if (self.exchange.ep_size > 1
                and self._sms_checked_on != (x.dtype, x.device)):
            if x.is_cuda and checks.takes_comm_sms(c):
                checks.check_comm_num_sm(c.comm_num_sm, sm_count(x.device))
            self._sms_checked_on = (x.dtype, x.device)
        if c.expert_precision == "fp8_rowwise" and self._fp8_checked_on != (x.dtype, x.device):
            check_fp8_call(x)
            self._fp8_checked_on = (x.dtype, x.device)
        if region is not None and not c.recompute_in_checkpoint:
            out, logits = self._forward_kept(x2, region, seq_len)
        else:
            out, logits = self._forward_routed(x2, region, seq_len)
        out = out.reshape(shape)
        return (out, logits) if return_router_logits else out


def _keep(t):
    return t


def _cast(t, dtype):
    return t if t is None or dtype is None else t.to(dtype)
