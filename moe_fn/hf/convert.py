"""``convert``: swap each Hugging Face sparse MoE block for one whose routed experts run on a
MoELayer, in place, keeping HF's parameter names, shapes and outputs.

How a block is converted (no copies, nothing re-registered):

- The block instance stays where it is, with its children (router, experts, shared
  experts), parameters, buffers and hooks; only its class becomes a subclass of HF's
  (``MoeFn<HFBlock>``) whose ``forward`` runs the preset's code around the routed experts.
  ``isinstance`` checks of HF code (weight init, output capture) still hold.
- A MoELayer, held by the block outside the module tree (so ``state_dict()`` keys are
  exactly HF's), reads the router weight (and bias), the score-correction bias and the
  experts' ``gate_up_proj`` / ``down_proj`` (and biases) through views of the block's own
  children: the same Parameter objects (GPT-OSS's transposed ones as ``.transpose(1, 2)``
  views), never a copy. ``.to()``, ``load_state_dict`` and optimizers see HF's
  parameters only.
- The router's class becomes ``MoeFn<HFRouter>``: called normally it is HF's router; the
  block calls it once per forward with HF's input and the MoELayer's logits so that HF's
  output-capture hooks (``_can_record_outputs`` / ``OutputRecorder`` on the router class)
  record the same ``router_logits`` (and the aux loss sees them), gradients included, and
  while hooks are registered, with the routing weights and expert indices the layer
  computed, in HF's shapes and dtypes (the preset's ``router_input`` / ``router_output``).
- The HF decoder layer around a block gets ``moe_fn.replay`` around the checkpoint function
  HF's ``gradient_checkpointing_enable`` gives it (before or after ``convert``): the
  recompute replays the forward's routes and dispatch layouts, honours
  ``skip_recompute_combine`` under a reentrant checkpoint, and with
  ``recompute_in_checkpoint=False`` does not recompute the MoE layers at all.
- With ``ep_size > 1`` rank r keeps experts ``r*E/ep ... (r+1)*E/ep - 1``: the experts'
  parameters are replaced by that slice (shape ``(E/ep, ...)`` in ``state_dict``);
  :func:`gather_expert_state_dict` reassembles full HF-shaped tensors. Build optimizers after
  ``convert``.
"""

from __future__ import annotations

import functools
import re
import warnings

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module

from ..config import REMOVED_OPTIONS, MoEConfig, _positive_int
from ..layer import MoELayer, RunWithExperts
from ..layer_checks import RefuseNonfiniteBias
from ..layer_checks import balance_group as checked_balance_group
from ..placement import (
    GuardedExperts,
    ep_group_and_mesh,
    experts_module_setup,
    local,
    prepare_fsdp_experts,
    register_expert_state_hooks,
    shard_experts,
)
from ..pure.router import sorted_topk
from ..replay import current_region, wrap_checkpoint
from .aux_loss import AuxLossHooks, AuxLossTerm, computes_hf_aux_loss
from .presets import MODEL_TYPES, PRESETS, Preset

__all__ = ["convert", "converted_blocks", "gather_expert_state_dict"]

# MoEConfig fields a preset derives from the model (passing them would break equivalence).
DERIVED = ("hidden_size", "intermediate_size", "num_experts", "top_k", "activation",
           "activation_alpha", "activation_limit", "gate_up_layout", "score_func",
           "norm_topk_prob", "n_group", "topk_group", "group_score", "score_correction_bias",
           "routed_scaling_factor", "router_bias", "expert_bias", "ep_size")
OPTIONS = tuple(f.name for f in attrs.fields(MoEConfig) if f.name not in DERIVED)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
EXPERT_BIASES = ("gate_up_proj_bias", "down_proj_bias")


def _expert_params(config: MoEConfig) -> tuple[str, ...]:
    """The HF experts' parameters split over expert-parallel ranks (dim 0 is the expert)."""
    return EXPERT_PARAMS + (EXPERT_BIASES if config.expert_bias else ())


def _supported() -> str:
    return ", ".join(f"{p.name} (model_type {'/'.join(p.model_types)})"
                     for p in PRESETS.values())


def _get_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


class _RouterView(nn.Module):
    """What MoELayer reads as its router: the HF router's weight (and bias, GPT-OSS) and the
    HF block's score-correction bias, looked up on every access (never copied; a ``(1, E)``
    bias is read as its ``(E,)`` view)."""

    def __init__(self, block: nn.Module, preset: Preset, router_bias: bool):
        super().__init__()
        self.__dict__["_block"] = block  # not a child: the block is not the layer's
        self._router_attr = preset.router_attr
        self._router_weight = preset.router_weight
        self._bias_attr = preset.bias_attr
        self._float32 = preset.router_dtype == "float32"
        self._router_bias = router_bias

    @property
    def weight(self):
        w = _get_path(getattr(self._block, self._router_attr), self._router_weight)
        return w.float() if self._float32 else w

    @property
    def bias(self):
        if not self._router_bias:
            return None
        b = getattr(self._block, self._router_attr).bias
        return b.float() if self._float32 else b

    @property
    def e_score_correction_bias(self):
        if self._bias_attr is None:
            return None
        b = _get_path(self._block, self._bias_attr)
        return b.view(-1) if b.dim() == 2 else b  # ERNIE-4.5 keeps it as (1, E)


class _ExpertsView(nn.Module):
    """What MoELayer reads as its experts: the HF experts' own parameters, as
    ``.transpose(1, 2)`` views where HF stores them transposed (GPT-OSS ``(E, H, 2I)`` /
    ``(E, I, H)``): views, never copies, so gradients land on HF's parameters."""

    def __init__(self, block: nn.Module, preset: Preset):
        super().__init__()
        self.__dict__["_block"] = block
        self._experts_attr = preset.experts_attr
        self._transposed = preset.transposed

    def _get(self, name):
        # A DTensor parameter (a layer on a mesh) is read as this rank's shard.
        return local(getattr(getattr(self._block, self._experts_attr), name))

    @property
    def holder(self) -> nn.Module:
        """The HF experts module: where the parameters live (FSDP2 shards it)."""
        return getattr(self._block, self._experts_attr)

    def forward(self, run, *args, **kwargs):
        """The MoELayer's forward, run as the HF experts module's (inside its hooks: FSDP2's
        where the experts are a unit of their own)."""
        return getattr(self._block, self._experts_attr)(run, *args, **kwargs)

    @property
    def gate_up_proj(self):
        w = self._get("gate_up_proj")
        return w.transpose(1, 2) if self._transposed else w

    @property
    def down_proj(self):
        w = self._get("down_proj")
        return w.transpose(1, 2) if self._transposed else w

    @property
    def gate_up_proj_bias(self):
        return self._get("gate_up_proj_bias")

    @property
    def down_proj_bias(self):
        return self._get("down_proj_bias")


class _ConvertedExperts(GuardedExperts):
    """Mixin for a converted block's HF experts module: called with a ``RunWithExperts`` it
    runs the MoELayer's forward (``MoEExperts.forward``); otherwise HF's own forward."""

    def forward(self, *args, **kwargs):
        if args and isinstance(args[0], RunWithExperts):
            prepare_fsdp_experts(self, self.__dict__.get("_moe_fn_ep_size", 1))
            return args[0](*args[1:], **kwargs)
        return super().forward(*args, **kwargs)


class HFMoELayer(MoELayer):
    """MoELayer whose router input is cast as the HF router does before its linear:
    ``router_dtype`` "float32" (DeepSeek/GLM: input and weight in float32) or "weight"
    (MiniMax: input cast to the weight's dtype); None leaves it as it comes. With
    ``choose_on_logits`` the experts are chosen on the logits, not the scores (Llama-4)."""

    router_dtype: str | None = None

    def router_input_dtype(self, x_dtype: torch.dtype) -> torch.dtype:
        if self.router_dtype == "float32":
            return torch.float32
        if self.router_dtype == "weight":
            return self.router.weight.dtype
        return x_dtype

    # Llama-4: HF takes the top-k on the raw logits and the sigmoid of the chosen ones after
    # (the float32 sigmoid rounds distinct large logits to equal scores, where a choice on
    # the scores would break the tie by index): the choice is made here, on the logits the
    # route computes, and the route weighs those experts as it weighs a replayed route.
    choose_on_logits: bool = False

    def extra_balance_terms(self) -> tuple:
        # transformers' own loss under a reentrant checkpoint, set by the block per call.
        return self.__dict__.get("_moe_fn_terms", ())

    def route(self, x2: torch.Tensor, replay_idx=None):
        x2 = x2.to(self.router_input_dtype(x2.dtype))
        if self.choose_on_logits and replay_idx is None:
            with torch.no_grad():
                logits = F.linear(x2, *self.router_params(x2))
                replay_idx = sorted_topk(logits, self.config.top_k)
        logits, idx, w = super().route(x2, replay_idx)
        # A list here while the block's router has hooks to read the route (kept by the
        # block for one call): the expert indices and routing weights the layer computed.
        routes = self.__dict__.get("_moe_fn_routes")
        if routes is not None:
            routes.append((idx, w))
        return logits, idx, w


class _RecordingRouter:
    """Mixin for the HF router class: a call while ``_moe_fn_output`` is set (by the
    converted block, for that call) returns the output it holds, so that forward hooks
    (HF's output capture, a user's reader) see what HF's router would return; any other
    call is HF's router."""

    def forward(self, *args, **kwargs):
        handed = self.__dict__.pop("_moe_fn_output", None)
        if handed is None:
            return super().forward(*args, **kwargs)
        expected, output = handed
        if kwargs or len(args) != len(expected) or any(a is not b
                                                       for a, b in zip(args, expected)):
            # A forward pre-hook replaced the router's input: HF would route by it.
            raise RuntimeError(
                f"a forward pre-hook on the router ({type(self).__name__}) changed its "
                "input; the converted block routes inside its MoELayer, on the block's "
                "input, and would ignore the change. Hooks that only read the router's "
                "input work; to route on another input, leave this block unconverted "
                "(moe_layer_pattern)")
        return output


def _has_hooks(module: nn.Module) -> bool:
    """Whether a call of ``module`` runs forward hooks or pre-hooks (its own or global)."""
    return bool(module._forward_hooks or module._forward_pre_hooks
                or _torch_module._global_forward_hooks
                or _torch_module._global_forward_pre_hooks)


class _Written:
    """What a router's hooks are handed, to tell afterwards whether one wrote into it: the
    tensors' version counters (values, for inference tensors, which have none)."""

    def __init__(self, tensors):
        self.tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        self.seen = [t.clone() if t.is_inference() else t._version for t in self.tensors]

    def any(self) -> bool:
        for t, seen in zip(self.tensors, self.seen):
            if not isinstance(seen, torch.Tensor):
                if t._version != seen:
                    return True
            elif not bool(((t == seen) | (t.isnan() & seen.isnan())).all()):
                return True
        return False


class ConvertedBlock:
    """Mixin for a converted HF MoE block; ``moe_layer`` is the MoELayer running its
    routed experts and ``moe_preset`` the preset that wrote its forward."""

    @property
    def moe_layer(self) -> MoELayer:
        return self.__dict__["_moe_fn_layer"]

    @property
    def moe_preset(self) -> Preset:
        return self.__dict__["_moe_fn_preset"]

    def _moe_fn_routed(self, x: torch.Tensor, return_router_logits: bool = False, *,
                       seq_len=None):
        layer = self.moe_layer
        preset = self.moe_preset
        router = getattr(self, preset.router_attr)
        # Only hooks see the router's call: without any, it costs a call and nothing else.
        hooked = _has_hooks(router)
        hooks = self.__dict__.get("_moe_fn_aux")
        aux = None if hooks is None else hooks.current
        region = current_region()
        fresh = region is None or not region.replaying
        # Inside a reentrant checkpoint the logits transformers captures carry no gradient:
        # the layer adds its loss's gradient itself (moe_fn.hf.aux_loss).
        inject = aux is not None and fresh and region is not None and region.reentrant
        if aux is not None and fresh:
            hooks.check_layer(layer.config)
        layer.__dict__["_moe_fn_terms"] = (AuxLossTerm(aux),) if inject else ()
        if hooked:
            layer.__dict__["_moe_fn_routes"] = routes = []
        try:
            out, logits = layer(x, return_router_logits=True, seq_len=seq_len)
        finally:
            layer.__dict__["_moe_fn_terms"] = ()
            layer.__dict__.pop("_moe_fn_routes", None)
        if aux is not None and fresh:
            if inject and logits.requires_grad:
                raise RuntimeError("a reentrant checkpoint's forward produced router logits "
                                   "with autograd: transformers' loss would train twice")
            aux.add(logits)
        # The router's call: HF's input, and HF's output (router_logits, top-k weights,
        # top-k indices; Llama-4's scores, logits) with the MoELayer's logits where output
        # capture records them and, for hooks, the weights and indices the layer computed.
        if hooked:
            args = preset.router_input(self, x)
            given = preset.router_output(logits, *self._moe_fn_route(routes, logits,
                                                                     args[0], region))
            written = _Written((*args, *given))
        else:
            args, given, written = (x,), preset.router_output(logits), None
        router.__dict__["_moe_fn_output"] = (args, given)
        try:
            seen = router(*args)
        finally:
            router.__dict__.pop("_moe_fn_output", None)
        if seen is not given or (written is not None and written.any()):
            # A hook replaced (or wrote into) the router's output or input: HF would route
            # by it, but this block has already routed inside its MoELayer.
            names = [getattr(h, "__qualname__", repr(h))
                     for h in (*router._forward_pre_hooks.values(),
                               *router._forward_hooks.values())]
            raise RuntimeError(
                f"a forward hook on the router ({preset.router_attr}: "
                f"{type(router).__name__}, hooks {names or 'global'}) changed its output (or "
                "wrote into its input or output); the converted block routes inside its "
                "MoELayer and would ignore the change. Hooks that only read the router's "
                "input and output work; to change the routing, change the router's weights, "
                "or leave this block unconverted (moe_layer_pattern)")
        return (out, logits) if return_router_logits else out

    def _moe_fn_route(self, routes, logits, router_input, region) -> tuple:
        """``(weights, indices)`` as HF's router returns them, from the route the layer
        computed in this call (``routes``) or, in a recompute that does not run the layer
        (``recompute_in_checkpoint=False``), the one its forward kept here."""
        c, preset = self.moe_layer.config, self.moe_preset
        kept = region is not None and not c.recompute_in_checkpoint
        if routes:
            idx, w = routes[-1]
            if kept and not region.replaying and region.grad_at_call:
                # The recompute returns the forward's outputs: it hands hooks this route.
                region.__dict__.setdefault("_moe_fn_hf_routes", {}).setdefault(
                    id(self), []).append((idx, w.detach(), w.requires_grad))
        else:
            pending = (region.__dict__.get("_moe_fn_hf_routes", {}).get(id(self))
                       if kept and region.replaying else None)
            if not pending:
                raise RuntimeError(
                    f"a hook on the router ({preset.router_attr}) was registered between "
                    "a checkpoint's forward and its recompute: with "
                    "recompute_in_checkpoint=False the recompute does not route again and "
                    "the forward kept no route for the hook to read; register hooks on the "
                    "router before the forward")
            idx, w, grad = pending.pop(0)
            # A leaf requiring grad where the forward's weights did, as the layer's kept
            # outputs: what reads it saves for backward what it saved the first time.
            w = w.detach().requires_grad_(grad)
        if not torch.is_grad_enabled():  # as HF's, computed without autograd
            w = w.detach()
        if not preset.router_weights_scaled and c.routed_scaling_factor != 1.0:
            w = w / c.routed_scaling_factor  # HF scales the experts' sum instead
        dtype = {"logits": logits.dtype, "float32": torch.float32,
                 "input": router_input.dtype}[preset.router_weights_dtype]
        return w.to(dtype), idx

    def forward(self, hidden_states, *args, **kwargs):
        routed = self._moe_fn_routed
        if self.moe_layer.config.seq_aux_loss_coef and hidden_states.dim() == 3:
            # The preset may flatten the tokens: the layer's sequences are the block's.
            routed = functools.partial(routed, seq_len=hidden_states.shape[1])
        return self.moe_preset.forward(self, hidden_states, routed)

    def train(self, mode: bool = True):
        super().train(mode)
        self.moe_layer.train(mode)
        return self


def _use_reentrant(fn) -> bool | None:
    """Whether HF's checkpoint function (``functools.partial(checkpoint, **kwargs)``) is
    reentrant, or None when that cannot be read off it."""
    kw = getattr(fn, "keywords", None)
    if isinstance(kw, dict) and isinstance(kw.get("use_reentrant"), bool):
        return kw["use_reentrant"]
    if (isinstance(kw, dict) and kw.get("use_reentrant") is None
            and getattr(fn, "func", None) is torch.utils.checkpoint.checkpoint):
        return True  # what torch does when it is not passed (with a warning)
    return None


class _ReplayCheckpointLayer:
    """Mixin for the HF decoder layer holding a converted block: the checkpoint function HF
    assigns (``gradient_checkpointing_enable``) is wrapped by ``moe_fn.replay.wrap_checkpoint``
    so the recompute replays each MoELayer's route and dispatch layout (and, with
    ``skip_recompute_combine`` and a reentrant checkpoint, skips the forward combine: the
    presets' decoder layers use the block's output only in the residual add). A function
    whose reentrancy cannot be read is kept as is (ordinary recompute, with a warning), and
    refused when a layer's options need the replay (``skip_recompute_combine``,
    ``recompute_in_checkpoint=False``), which would otherwise be silently ignored."""

    @property
    def _gradient_checkpointing_func(self):
        if self.gradient_checkpointing:  # HF reads it only to checkpoint
            self._judge_checkpoint()
        return self.__dict__.get("_moe_fn_ckpt_func")

    @_gradient_checkpointing_func.setter
    def _gradient_checkpointing_func(self, fn):
        reentrant = _use_reentrant(fn)
        unread = False
        if fn is not None and not getattr(fn, "moe_fn_replay", False):
            if reentrant is not None:
                fn = wrap_checkpoint(fn, use_reentrant=reentrant)
                if reentrant:
                    _warn_untrained_aux_loss(self)
                skipping = [m.moe_layer for m in self.modules()
                            if isinstance(m, ConvertedBlock)
                            and m.moe_layer.config.skip_recompute_combine]
                if not reentrant and skipping:
                    # The contract: the skip runs in reentrant recomputes only. Said once
                    # here, where a default mode picked by transformers would hide it (and
                    # so not again by the layers at their first recompute).
                    for layer in skipping:
                        layer.skip_mode_warned = True
                    warnings.warn(
                        "skip_recompute_combine=True does not apply under a non-reentrant "
                        "checkpoint (replay still runs): pass gradient_checkpointing_kwargs="
                        "{'use_reentrant': True} to checkpoint reentrantly", stacklevel=3)
            else:
                unread = True
        self.__dict__["_moe_fn_ckpt_func"] = fn
        self.__dict__["_moe_fn_ckpt_unread"] = unread

    # HF assigns the function before the flag, and on disable assigns its bare default
    # function while the flag is still on: a function whose mode cannot be read is judged
    # when checkpointing is switched on or used, so disabling is quiet and enabling still
    # refuses before a step.
    @property
    def gradient_checkpointing(self):
        return self.__dict__.get("_moe_fn_ckpt_on", False)

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on):
        if on:  # a refused function leaves the flag as it was
            self._judge_checkpoint()
        self.__dict__["_moe_fn_ckpt_on"] = on

    def _judge_checkpoint(self):
        if self.__dict__.get("_moe_fn_ckpt_unread"):
            # Raises while the layer's options need the replay (at every use, so a caught
            # refusal does not let a later step through); otherwise warns, once.
            self._unreadable_checkpoint(self.__dict__["_moe_fn_ckpt_func"])
            self.__dict__["_moe_fn_ckpt_unread"] = False

    def _unreadable_checkpoint(self, fn):
        needs = _replay_needs((m.moe_layer.config.skip_recompute_combine,
                               m.moe_layer.config.recompute_in_checkpoint)
                              for m in self.modules() if isinstance(m, ConvertedBlock))
        if needs:
            raise ValueError(_unreadable_refusal(fn, needs))
        what, fix = _unreadable_text(fn)
        warnings.warn(f"{what}: {fix}", stacklevel=3)


def _warn_untrained_aux_loss(decoder_layer) -> None:
    # Blocks holding the model's hooks train transformers' loss themselves.
    coefs = {m.__dict__.get("_moe_fn_aux_loss_coef") for m in decoder_layer.modules()
             if isinstance(m, ConvertedBlock) and m.__dict__.get("_moe_fn_aux") is None}
    coefs = sorted(c for c in coefs if c)
    if coefs:
        warnings.warn(
            f"transformers' load-balancing loss (router_aux_loss_coef={coefs[0]}) does not "
            "train the routers under reentrant gradient checkpointing: it is computed from "
            "router logits recorded in the checkpoint's forward, which runs without autograd, "
            "so the loss has no gradient (transformers' own model behaves the same). moe_fn "
            "trains it itself when convert() is given the model whose forward computes that "
            "loss and converts every MoE block of it. Otherwise checkpoint non-reentrantly "
            "(use_reentrant=False), or balance with the in-layer loss (convert(..., "
            "aux_loss_coef=...), which trains in every checkpoint mode)", stacklevel=4)


def _replay_needs(settings) -> list[str]:
    """Among ``(skip_recompute_combine, recompute_in_checkpoint)`` settings, the options
    that only a replaying checkpoint honours."""
    return sorted({opt for skip, recompute in settings
                   for opt, on in (("skip_recompute_combine=True", skip),
                                   ("recompute_in_checkpoint=False", not recompute))
                   if on})


def _unreadable_text(fn) -> tuple[str, str]:
    what = (f"moe_fn cannot tell whether the checkpoint function {fn!r} is reentrant, "
            "so its recompute routes the MoE layers again (no replay)")
    fix = ("pass gradient_checkpointing_kwargs={'use_reentrant': True} (or False) to "
           "gradient_checkpointing_enable")
    return what, fix


def _unreadable_refusal(fn, needs) -> str:
    what, fix = _unreadable_text(fn)
    return (f"{what}, and {', '.join(needs)} would be ignored: {fix}, or convert without "
            "those options")


def _checkpoint_layer(model: nn.Module, block_name: str):
    """The HF decoder layer (a ``GradientCheckpointingLayer``) holding a block, or None."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers without checkpointing layers
        return None
    parts = block_name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = model.get_submodule(".".join(parts[:i]))
        if isinstance(parent, GradientCheckpointingLayer):
            return parent
    return None


def _enable_replay(model: nn.Module, block_name: str) -> None:
    parent = _checkpoint_layer(model, block_name)
    if parent is not None and not isinstance(parent, _ReplayCheckpointLayer):
        fn = parent.__dict__.pop("_gradient_checkpointing_func", None)
        on = parent.__dict__.pop("gradient_checkpointing", type(parent).gradient_checkpointing)
        parent.__class__ = _subclass(_ReplayCheckpointLayer, type(parent))
        parent._gradient_checkpointing_func = fn
        parent.gradient_checkpointing = on


_CLASSES: dict[tuple[type, type], type] = {}


def _subclass(mixin: type, base: type) -> type:
    cls = _CLASSES.get((mixin, base))
    if cls is None:
        cls = type(f"MoeFn{base.__name__}", (mixin, base),
                   {"__module__": __name__, "__doc__": f"{base.__name__} converted by moe_fn.hf.",
                    "__reduce_ex__": _reduce_made, "_moe_fn_made": (mixin, base)})
        _CLASSES[(mixin, base)] = cls
    return cls


def _reduce_made(self, protocol):
    # The class is made at conversion, so pickle cannot find it by name: an instance is
    # pickled as its two bases (importable) and its state, and remade from them on load.
    # A subclass of it (FSDP2's, say) is pickled as Python pickles any class.
    reduced = object.__reduce_ex__(self, protocol)
    made = type(self).__dict__.get("_moe_fn_made")
    return reduced if made is None else (_remake, made) + tuple(reduced[2:])


def _remake(mixin: type, base: type):
    cls = _subclass(mixin, base)
    return cls.__new__(cls)


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def resolve_preset(model: nn.Module, preset: str | None = None) -> Preset:
    """The preset named by ``preset``, or the one serving ``model.config.model_type``."""
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; supported presets: {_supported()}")
        return PRESETS[preset]
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} has no moe_fn preset; pass preset= for a "
                         f"model of a supported family. Supported: {_supported()}")
    return PRESETS[MODEL_TYPES[model_type]]


def _check_options(options: dict, moe_layer_pattern, preset: Preset) -> None:
    for name in options:
        if name in REMOVED_OPTIONS:
            raise ValueError(f"option {name!r} was removed: use {REMOVED_OPTIONS[name]}")
    derived = sorted(set(options) & set(DERIVED))
    if derived:
        raise ValueError(f"{derived} are set by the preset from the model (routing, sizes, "
                         f"activation) or by ep_size=; options may set only {list(OPTIONS)}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; options are MoEConfig fields: "
                         f"{list(OPTIONS)}")
    own = sorted(set(options) & set(preset.derived_options))
    if own:
        allowed = [o for o in OPTIONS if o not in preset.derived_options]
        raise ValueError(f"{preset.name}: {own} set by the preset, not an option: "
                         f"{preset.derived_reason}; options may set only {allowed}")
    if options.get("score_apply") == "pre":
        raise ValueError(
            "score_apply='pre' weights the experts' inputs, which changes what a nonlinear "
            "expert computes: HF weights the experts' outputs. Use 'post' (the default) or "
            "'activation' (the weight folded into the activation output, before the linear "
            "down projection: the same function)")
    if moe_layer_pattern is not None and options.get("skip_recompute_combine"):
        raise ValueError(
            "skip_recompute_combine=True cannot be combined with a custom moe_layer_pattern: "
            "the skip is only correct when the MoE output feeds nothing but the decoder "
            "layer's residual add, which is proven for the presets' blocks and cannot be for "
            "an arbitrary parent module")


def _find_blocks(model, block_cls, pattern) -> list[tuple[str, nn.Module]]:
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, block_cls)]
    for n, m in blocks:
        if isinstance(m, ConvertedBlock):
            raise ValueError(f"{n or 'the model'} is already converted: convert() runs once "
                             "per model, with one set of options for every block it "
                             "converts (moe_layer_pattern included); convert a fresh copy")
    if pattern is None:
        if not blocks:
            raise ValueError(f"the model has no {block_cls.__name__} module to convert")
        return blocks
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"moe_layer_pattern {pattern!r} is not a valid regular expression: "
                         f"{e}") from None
    chosen = [(n, m) for n, m in blocks if rx.fullmatch(n)]
    if not chosen:
        names = [n for n, _ in blocks]
        raise ValueError(f"moe_layer_pattern {pattern!r} matches no {block_cls.__name__} "
                         f"(the pattern must fully match a qualified module name; the model's "
                         f"blocks are {names[:8]}{' ...' if len(names) > 8 else ''})")
    return chosen


def _block_config(name, block, preset: Preset, text_config, ep_size, options) -> MoEConfig:
    """The MoEConfig a block runs as; what the model's config (and the options) make and the
    layer cannot run is refused, naming the preset and the block."""
    router = getattr(block, preset.router_attr)
    num_experts, two_i, hidden = _ExpertsView(block, preset).gate_up_proj.shape  # (E, 2I, H)
    options = dict(options)
    options.setdefault("comm_backend", "all_to_all" if ep_size > 1 else "local")
    try:
        return MoEConfig(hidden_size=hidden, intermediate_size=two_i // 2,
                         num_experts=num_experts, top_k=int(router.top_k), ep_size=ep_size,
                         **preset.routing(text_config), **options)
    except ValueError as e:
        raise ValueError(f"{preset.name}: {name or 'the model'} cannot be converted: its "
                         f"config with the options given makes a MoE layer moe_fn cannot "
                         f"run: {e}") from None


def _convert_block(block, preset: Preset, config: MoEConfig, process_group, ep_size,
                   aux_loss_coef: float = 0.0, balance_group=None, aux_hooks=None):
    experts = getattr(block, preset.experts_attr)
    router = getattr(block, preset.router_attr)
    gate_up = _ExpertsView(block, preset).gate_up_proj
    layer = HFMoELayer(config, process_group, balance_group=balance_group, device="meta",
                       dtype=gate_up.dtype)
    layer.router_dtype = preset.router_dtype
    layer.choose_on_logits = preset.choose_on_logits
    layer.router = _RouterView(block, preset, config.router_bias)
    layer.experts = _ExpertsView(block, preset)
    if ep_size > 1:
        n = config.num_local_experts
        lo = layer.ep_rank * n
        for name in _expert_params(config):
            full = getattr(experts, name)
            part = full.detach()[lo:lo + n].clone()
            if layer.ep_mesh is not None:  # on a mesh: a DTensor Shard(0) over it
                part = shard_experts(part, layer.ep_mesh, config.num_experts)
            setattr(experts, name, nn.Parameter(part, requires_grad=full.requires_grad))
        # state_dict() says the slices are shards (DTensors), as MoELayer's does.
        register_expert_state_hooks(block, [f"{preset.experts_attr}.{name}"
                                            for name in _expert_params(config)])
    layer.train(block.training)
    block.__dict__["_moe_fn_layer"] = layer
    block.__dict__["_moe_fn_preset"] = preset
    block.__dict__["_moe_fn_aux_loss_coef"] = aux_loss_coef
    block.__dict__["_moe_fn_aux"] = aux_hooks
    if preset.bias_attr is not None:
        block.register_load_state_dict_pre_hook(RefuseNonfiniteBias(preset.bias_attr))
    router.__class__ = _subclass(_RecordingRouter, type(router))
    experts.__class__ = _subclass(_ConvertedExperts, type(experts))
    experts_module_setup(experts, ep_size)
    block.__class__ = _subclass(ConvertedBlock, type(block))


def convert(model: nn.Module, *, process_group=None, ep_size: int = 1, preset: str | None = None,
            moe_layer_pattern: str | None = None, balance_group=None, ep_mesh=None,
            **options) -> nn.Module:
    """Convert every sparse MoE block of a Hugging Face model in place; returns ``model``.

    preset: a name in ``moe_fn.hf.PRESETS``; default from ``model.config.model_type``.
    moe_layer_pattern: a regex that must fully match the qualified names of the blocks to
    convert (among the preset's block class); default all of them.
    ep_size / process_group: expert parallelism over a group of ``ep_size`` ranks (default
    the world group); each rank keeps its slice of the experts, and ``comm_backend``
    defaults to "all_to_all" (``"local"`` for ep_size 1).
    ep_mesh: instead of ``process_group``, a 1-D DeviceMesh (``mesh["ep"]``): the expert
    parameters become DTensors ``Shard(0)`` over it (``moe_fn.placement``); ``ep_size``
    defaults to its size.
    balance_group: with ``aux_loss_scope="group"``, the group whose whole batch the
    in-layer Switch loss counts (MoELayer's ``balance_group``; default the world group).
    transformers' own load-balancing loss (``output_router_logits`` with
    ``router_aux_loss_coef``) trains as in the unconverted model without checkpointing,
    reentrant HF checkpointing included, when ``model`` is the model whose forward computes
    it and every MoE block is converted (``moe_fn.hf.aux_loss``).
    options: MoEConfig options that do not change what is computed (``OPTIONS``):
    gate_up_impl, score_apply ("post" or "activation"; "pre" is refused; Llama-4's is
    "pre", set by its preset, and refused as an option),
    impl, comm_backend, comm_num_sm, overlap_weight_grad, skip_recompute_combine,
    recompute_in_checkpoint, and the in-layer balancing losses (aux_loss_coef,
    aux_loss_scope, seq_aux_loss_coef, z_loss_coef; docs/load_balancing.md); every default
    is MoEConfig's (the fastest correct choice).

    Raises ValueError for an unsupported model type, a pattern that matches no block, a
    block the preset cannot compute (Step-3.7's post-activation clamp), an unknown or
    preset-derived option (Llama-4's score_apply included), score_apply="pre" (or
    "activation" for GPT-OSS, whose routing weight also scales the experts' down bias), or
    ``skip_recompute_combine`` with a custom pattern.
    """
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers model (an nn.Module with a config), "
                        f"got {type(model).__name__}")
    for name, v in (("preset", preset), ("moe_layer_pattern", moe_layer_pattern)):
        if v is not None and not isinstance(v, str):
            raise TypeError(f"{name} must be a str or None, got {type(v).__name__}")
    p = resolve_preset(model, preset)
    _check_options(options, moe_layer_pattern, p)
    if ep_mesh is not None:
        if process_group is not None:
            raise ValueError("pass either process_group or ep_mesh (a 1-D DeviceMesh), not "
                             "both: the layers run on one expert-parallel group")
        _, mesh = ep_group_and_mesh(ep_mesh, "ep_mesh")
        if mesh is None:
            raise TypeError(f"ep_mesh must be a 1-D DeviceMesh (e.g. mesh['ep']), got "
                            f"{type(ep_mesh).__name__}: pass a ProcessGroup as process_group")
        if ep_size == 1:
            ep_size = mesh.size()
        process_group = mesh
    _positive_int("ep_size", ep_size)
    text_config = _text_config(model.config)
    blocks = list(_find_blocks(model, p.cls("block"), moe_layer_pattern))
    _check_blocks(p, blocks)
    _check_checkpoint_functions(model, [name for name, _ in blocks], options)
    # Every block's config first: a refusal leaves the model whole.
    configs = [_block_config(name, block, p, text_config, ep_size, options)
               for name, block in blocks]
    # HF adds its load-balancing loss when the config asks for router logits (in the
    # families that have one: DeepSeek's and GLM's configs carry a coefficient no model
    # of theirs reads).
    has_loss = hasattr(p.modeling(), "load_balancing_loss_func")
    aux_coef = (getattr(text_config, "router_aux_loss_coef", 0.0) or 0.0
                if has_loss and getattr(text_config, "output_router_logits", False) else 0.0)
    checked_balance_group(configs[0], balance_group)  # refused before anything is converted
    # Hooks that train transformers' loss under reentrant checkpointing: only where the
    # model's forward computes it and no MoE block is left out (its router's logits would
    # enter the counts, but its gradient could not be added).
    aux_hooks = None
    every_block = len(blocks) == len(_find_blocks(model, p.cls("block"), None))
    if computes_hf_aux_loss(model) and every_block:
        aux_hooks = AuxLossHooks()
        model.register_forward_pre_hook(aux_hooks.pre_hook, with_kwargs=True)
        model.register_forward_hook(aux_hooks.post_hook, always_call=True)
    for (name, block), config in zip(blocks, configs):
        _convert_block(block, p, config, process_group, ep_size, aux_coef, balance_group,
                       aux_hooks)
        _enable_replay(model, name)
    return model


def _check_blocks(preset: Preset, blocks) -> None:
    """Refuse, before anything is converted, a block whose own settings the MoELayer cannot
    compute (the preset's ``check``)."""
    if preset.check is None:
        return
    for name, block in blocks:
        reason = preset.check(block)
        if reason is not None:
            raise ValueError(f"{preset.name}: {name or 'the model'} cannot be converted: "
                             f"{reason}; leave it out with moe_layer_pattern (a regex "
                             "fully matching the names of the blocks to convert)")


def _check_checkpoint_functions(model: nn.Module, block_names, options: dict) -> None:
    """Refuse, before anything is converted, options that need the replay when a decoder
    layer already holds a checkpoint function whose reentrancy cannot be read (converting
    first would leave the model half converted)."""
    needs = _replay_needs([(options.get("skip_recompute_combine", False),
                            options.get("recompute_in_checkpoint", True))])
    if not needs:
        return
    for name in block_names:
        parent = _checkpoint_layer(model, name)
        fn = None if parent is None else parent.__dict__.get("_gradient_checkpointing_func")
        # Only where checkpointing is on: HF's disable leaves its bare default function.
        if fn is not None and parent.gradient_checkpointing \
                and not getattr(fn, "moe_fn_replay", False) and _use_reentrant(fn) is None:
            raise ValueError(_unreadable_refusal(fn, needs))


def converted_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, block)`` of every converted block of ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ConvertedBlock)]


def gather_expert_state_dict(model: nn.Module, process_group=None) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every expert-parallel tensor reassembled to HF's full shape.

    Collective: every rank of the expert-parallel group must call it. Experts' tensors of
    each converted block with ``ep_size > 1`` (``experts.gate_up_proj (E/ep, 2I, H)``,
    ``experts.down_proj (E/ep, H, I)``, in HF's own layout, and GPT-OSS's expert biases) are
    all-gathered over ``process_group`` (default each block's own group) and concatenated in
    rank order along the expert dimension; everything else is as ``state_dict()`` returns
    it. The result loads into an unconverted HF model of the same config.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    sd = model.state_dict()
    for key, block, pname in _expert_entries(model):
        layer = block.moe_layer
        ep = layer.config.ep_size
        if ep == 1:
            continue
        group = process_group if process_group is not None else layer.process_group
        experts = getattr(block, block.moe_preset.experts_attr)
        mine = local(getattr(experts, pname)).detach().contiguous()
        parts = [torch.empty_like(mine) for _ in range(ep)]
        dist.all_gather(parts, mine, group=group)
        sd[key] = torch.cat(parts, dim=0)
    return sd


def _expert_entries(model):
    """``(state-dict key, converted block, parameter name)`` of every expert parameter."""
    for name, block in converted_blocks(model):
        for pname in _expert_params(block.moe_layer.config):
            key = ".".join(filter(None, (name, block.moe_preset.experts_attr, pname)))
            yield key, block, pname


def expert_parameter_names(model) -> set[str]:
    """Names of the converted model's expert parameters (biases included): sharded over the
    expert-parallel group, unlike the replicated rest (which data parallelism averages)."""
    return {key for key, _, _ in _expert_entries(model)}
