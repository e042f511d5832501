"""What MoELayer checks, kept apart from the module and its forward: the parameters against
the config and the input (every call), the ranks' agreement (every fresh layout), CUDA
graph capture, the SMs the exchange takes, the balancing group, the sequence length, the
float16 scale and the score-correction bias (also on load, by a picklable state-dict hook).

Every check raises naming the problem and the fix; the common case costs a few
comparisons of host time.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .config import MoEConfig
from .placement import local


def takes_comm_sms(config: MoEConfig) -> bool:
    """Whether anything the config runs takes ``comm_num_sm`` SMs: DeepEP's kernels, the
    symm_mem exchange's pulls, the overlap's carveout (the other exchanges leave the
    SMs to NCCL and never read it)."""
    return config.ep_size > 1 and (
        config.comm_backend == "deepep" or config.overlap_weight_grad
        or config.comm_backend == "symm_mem")


def check_comm_num_sm(num_sms: int, sm_count: int) -> None:
    """The SMs the exchange takes (DeepEP's kernels, the symm_mem pulls, the overlap's
    carveout) must leave some to the experts' GEMMs."""
    if num_sms >= sm_count:
        raise ValueError(f"comm_num_sm={num_sms} leaves none of this GPU's {sm_count} SMs to "
                         f"the experts' GEMMs: use fewer (12-24 is typical)")



PARAMS = ("router.weight", "experts.gate_up_proj", "experts.down_proj")


def expected_param_shapes(c: MoEConfig) -> tuple:
    """The shapes of ``PARAMS`` a config needs."""
    return ((c.num_experts, c.hidden_size),
            (c.num_local_experts, 2 * c.intermediate_size, c.hidden_size),
            (c.num_local_experts, c.hidden_size, c.intermediate_size))


def expected_biases(c: MoEConfig) -> tuple:
    """``(name, config option, shape or None when the config has none)`` per bias."""
    e_loc, h, i = c.num_local_experts, c.hidden_size, c.intermediate_size
    return tuple((name, option, shape if on else None) for name, option, on, shape in (
        ("router.bias", "router_bias", c.router_bias, (c.num_experts,)),
        ("router.e_score_correction_bias", "score_correction_bias",
         c.score_correction_bias, (c.num_experts,)),
        ("experts.gate_up_proj_bias", "expert_bias", c.expert_bias, (e_loc, 2 * i)),
        ("experts.down_proj_bias", "expert_bias", c.expert_bias, (e_loc, h))))


def check_parameters(layer, x, amp=None) -> None:
    """The parameters against the config and ``x`` (a module's parameters can be
    replaced or moved piecemeal): shapes, one dtype, one device. Under autocast
    (``amp``, its dtype) each may also be float32, which the forward casts. The common
    case is a few comparisons (host time on every call); ``_explain_parameters`` says
    what differs."""
    # The expert parameters as this rank computes with them (a DTensor's local tensor).
    w, gu, dn = layer.router.weight, local(layer.experts.gate_up_proj), \
        local(layer.experts.down_proj)
    b = layer.router.bias
    dt, dev = amp or x.dtype, x.device
    if amp is not None:  # the casts in route() and expert_weights() make them agree
        w_dt = layer.router_input_dtype(amp)
        ok = all(t is None or t.dtype in (torch.float32, want)
                 for t, want in ((gu, dt), (dn, dt), (w, w_dt), (b, w_dt)))
    else:
        ok = (gu.dtype == dt and dn.dtype == dt and w.dtype == layer.router_input_dtype(dt)
              and (b is None or b.dtype == w.dtype))
    if (ok and gu.device == dev and dn.device == dev and w.device == dev
            and (w.shape, gu.shape, dn.shape) == layer._param_shapes
            and (b is None or b.device == dev)):
        _check_biases(layer, b, dt, dev, amp)
        return
    _explain_parameters(layer, x, (w, gu, dn), b, amp)


def _check_biases(layer, router_bias, dtype, device, amp=None) -> None:
    """The biases the config asks for are there, with their shapes, and no others: a
    missing one would silently drop a term, an extra one silently add (or be ignored).
    (A view of other modules' experts may not define absent biases at all.) The
    experts' biases have x's dtype and every bias x's device (the router bias's dtype
    is checked with the router weight's)."""
    ex = layer.experts
    found = (router_bias, layer.router.e_score_correction_bias,
             local(getattr(ex, "gate_up_proj_bias", None)),
             local(getattr(ex, "down_proj_bias", None)))
    expected = layer._bias_spec
    if all(t is None if shape is None else
           (t is not None and t.shape == shape and t.device == device
            and (i < 2 or t.dtype == dtype or (amp and t.dtype == torch.float32)))
           for i, (t, (_, _, shape)) in enumerate(zip(found, expected))):
        return
    for i, (t, (name, option, shape)) in enumerate(zip(found, expected)):
        wanted = shape is not None
        if (t is not None) != wanted:
            raise ValueError(
                f"{name} is {'missing' if wanted else 'set'} but the config has "
                f"{option}={wanted}: build the layer from a config with {option}="
                f"{not wanted}, or {'restore' if wanted else 'remove'} {name}")
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {shape} for this config, got "
                             f"{tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but x is on {device}: move the "
                             "layer to x's device (layer.to(x.device))")
        if i >= 2 and t.dtype != dtype and not (amp and t.dtype == torch.float32):
            raise TypeError(f"{name} is {t.dtype} but x is {dtype}: the experts' biases "
                            "take x's dtype (layer.to(x.dtype))")


def _explain_parameters(layer, x, params, bias, amp=None) -> None:
    for name, p, shape in zip(PARAMS, params, layer._param_shapes):
        if tuple(p.shape) != shape:
            raise ValueError(f"{name} must be {shape} for this config, got "
                             f"{tuple(p.shape)}")
    dt = amp or x.dtype
    router_in = layer.router_input_dtype(dt)
    for name, p, dtype in zip((*PARAMS, "router.bias"), (*params, bias),
                              (router_in, dt, dt, router_in)):
        if p is None:
            continue
        if amp is not None and p.dtype not in (dtype, torch.float32):
            raise TypeError(f"under torch.autocast({amp}) {name} is {p.dtype}: the "
                            f"layer's parameters must be float32 or {dtype}")
        if amp is None and p.dtype != dtype and autocast_on(x):
            kind = x.device.type
            raise TypeError(
                f"under torch.autocast({torch.get_autocast_dtype(kind)}) x is {x.dtype} "
                f"but {name} is {p.dtype}: pass x in float32 or "
                f"{torch.get_autocast_dtype(kind)} (autocast leaves {x.dtype} alone)")
        if amp is None and p.dtype != dtype:
            raise TypeError(
                f"x has dtype {x.dtype} but {name} is {p.dtype}: keep the layer in one "
                "dtype (layer.to(dtype)) and cast x to it; for mixed precision (float32 "
                "parameters, lower-precision compute, e.g. FSDP2's param_dtype with the "
                "experts ignored) run the forward under torch.autocast")
        if p.is_meta:
            raise ValueError(f"{name} is on the meta device (no data): {MATERIALIZE}")
        if p.device != x.device:
            raise ValueError(f"x is on {x.device} but {name} is on {p.device}: move x "
                             "or the layer (layer.to(device))")


def _agreement_stamp(layer, x) -> torch.Tensor:
    """What every rank of the expert-parallel group must share to exchange rows with
    the others: this layer's config, ``x``'s dtype and device type, hashed into a small
    int64 tensor on ``x``'s device (made once per dtype and device: no copy per call)."""
    key = (x.dtype, x.device)
    stamp = layer._stamps.get(key)
    if stamp is None:
        words = (repr(layer.config), str(x.dtype), x.device.type)
        # 31-bit words: they travel with int32 or int64 counts alike.
        stamp = torch.tensor([zlib.crc32(w.encode()) & 0x7FFFFFFF for w in words],
                             dtype=torch.int64, device=x.device)
        layer._stamps[key] = stamp
    return stamp


def _agree(x_dtype):
    """The check the exchange runs on every rank's stamps (the same list everywhere,
    so every rank raises together): every rank builds its layer from the same config
    and calls it in one dtype, else the exchange's collectives would mismatch sizes
    (a process abort in the backend, or a hang) or reinterpret rows bit for bit."""
    def check(rows):
        for rank, row in enumerate(rows):
            what = [w for w, a, b in zip(("config", "dtype", "device type"), row, rows[0])
                    if a != b]
            if what:
                raise ValueError(
                    f"rank {rank} of the expert-parallel group runs this MoELayer with "
                    f"another {' and '.join(what)} than rank 0 (this rank: {x_dtype}): "
                    "every rank must build its layer from the same MoEConfig and call it "
                    "in one dtype")
    return check


def agreement(layer, x) -> dict:
    """The layout's agreement arguments: none on one rank."""
    if layer.exchange.ep_size == 1:
        return {}
    return dict(stamp=_agreement_stamp(layer, x), agree=_agree(x.dtype))


def check_capturable(exchange, region) -> None:
    # A captured graph replays kernels only: the host-side work these paths do per
    # call (split sizes read back, replay entries recorded and consumed) would run
    # once, at capture, and every replay would reuse it.
    if exchange.backend != "local":
        raise RuntimeError(
            f"CUDA graph capture of a MoELayer needs comm_backend='local'; "
            f"{exchange.backend!r} reads split sizes on the host every call. "
            "Capture the dense parts only, or run this layer eagerly.")
    if region is not None:
        raise RuntimeError(
            "CUDA graph capture inside moe_fn.checkpoint or an HF checkpointed block "
            "is not supported: routing replay records and consumes entries on the "
            "host. Capture the layer outside the checkpoint, or run it eagerly.")


def balance_group(config: MoEConfig, group):
    """The group ``aux_loss_scope="group"`` counts over (default the world group), checked
    against the config: a group the config would not use is refused, not ignored."""
    if config.aux_loss_scope != "group":
        if group is not None:
            raise ValueError(f"balance_group is the group aux_loss_scope='group' counts the "
                             f"Switch loss's experts over; this config's aux_loss_scope is "
                             f"{config.aux_loss_scope!r}: pass no balance_group, or set "
                             "aux_loss_scope='group' (with aux_loss_coef > 0)")
        return None
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"balance_group must be a torch.distributed ProcessGroup or None, "
                        f"got {type(group).__name__}")
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("aux_loss_scope='group' all-reduces the expert counts over a "
                             "process group: initialise torch.distributed (the world group "
                             "is the default) or pass balance_group=..., or use "
                             "aux_loss_scope='micro_batch'")
        group = dist.group.WORLD
    return group


def sequence_length(x: torch.Tensor, seq_len, config: MoEConfig) -> int | None:
    """The sequence length the sequence-level loss reads ``x``'s tokens by (None without
    that loss); a ``seq_len`` that would be ignored or does not fit ``x`` is refused."""
    if seq_len is not None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if not config.seq_aux_loss_coef:
            raise ValueError("seq_len says where the sequences of a (T, H) input end, for the "
                             "sequence-level balancing loss; this config has "
                             "seq_aux_loss_coef=0: pass no seq_len, or set seq_aux_loss_coef")
    if not config.seq_aux_loss_coef:
        return None
    if x.dim() >= 3:
        if seq_len is not None and seq_len != x.shape[-2]:
            raise ValueError(f"seq_len={seq_len} but x of shape {tuple(x.shape)} holds "
                             f"sequences of {x.shape[-2]} tokens (its dimension -2): pass "
                             "no seq_len for such an input")
        return x.shape[-2]
    tokens = x.shape[0] if x.dim() == 2 else 1
    if seq_len is None:
        return max(tokens, 1)
    if tokens % seq_len:
        raise ValueError(f"seq_len={seq_len} does not divide the {tokens} tokens of x "
                         f"(shape {tuple(x.shape)}): a (T, H) input holds T / seq_len "
                         "whole sequences")
    return seq_len



def autocast_on(x: torch.Tensor) -> bool:
    kind = x.device.type
    return torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)


def autocast_dtype(x: torch.Tensor):
    """The dtype ``torch.autocast`` lowers float32 matmuls to on ``x``'s device, where it is
    on and ``x`` is float32 or already in that dtype (the output of a lowered op); else
    None (autocast leaves other dtypes alone)."""
    kind = x.device.type
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if not autocast_on(x):
        return None
    amp = torch.get_autocast_dtype(kind)
    return amp if amp != torch.float32 and x.dtype in (torch.float32, amp) else None


MATERIALIZE = ("materialize the layer first (layer.to_empty(device=...), then "
                "layer.reset_parameters() or load a state dict)")
META_DEVICE = ("x is on the meta device: a MoELayer routes each token by its values (its "
                "dispatch layout reads per-expert counts on the host), which meta tensors do "
                f"not have. Pass a real x and {MATERIALIZE}")


def check_score_correction_bias(bias: torch.Tensor, name: str) -> None:
    """A non-finite score-correction bias would silently send every token to that expert
    (NaN wins every comparison of the choice): refuse it (a host sync)."""
    bad = ~torch.isfinite(bias.detach())
    if bool(bad.any()):
        experts = bad.reshape(-1).nonzero().reshape(-1)[:8].tolist()
        raise ValueError(f"{name} has non-finite values (experts {experts}): every token would "
                         "be routed to such an expert. Load a finite bias (or zero it)")


class RefuseNonfiniteBias:
    """A load_state_dict pre-hook refusing a non-finite score-correction bias at ``key``
    (below the module's prefix) before it is copied in. A class, not a closure, so that a
    module holding it pickles, deep-copies and ``torch.save``s whole."""

    def __init__(self, key: str):
        self.key = key

    def __call__(self, module, state_dict, prefix, *args):
        value = state_dict.get(prefix + self.key)
        if isinstance(value, torch.Tensor) and not value.is_meta:
            check_score_correction_bias(value, f"state_dict[{prefix + self.key!r}]")


def check_float16_scale(factor: float) -> None:
    """A float16 layer applies its routing weights in float16: a routed_scaling_factor past
    float16's range overflows them to inf or flushes them to zero."""
    f16 = torch.finfo(torch.float16)
    if not f16.tiny <= factor <= f16.max:
        raise ValueError(f"routed_scaling_factor={factor!r} lies outside float16's range "
                         f"[{f16.tiny:.3g}, {f16.max:.3g}], in which this float16 layer "
                         "applies its routing weights: use a factor in that range, or run "
                         "the layer in bfloat16 or float32")

