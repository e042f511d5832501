"""The gated activation family, on separate ``(gate, up)`` or on packed ``gate_up``.

``act(g, u)`` for each activation (L = limit, a = alpha):

- ``swiglu``:          silu(g) * u
- ``swiglu_clamped``:  silu(min(g, L)) * clamp(u, -L, L)                (L defaults to 7)
- ``swiglu_oai``:      (clamp(u, -L, L) + 1) * g' * sigmoid(a * g'), g' = min(g, L)
                       (GPT-OSS, MiniMax-M3; a = 1.702 and L = 7 by default)
- ``geglu_tanh``:      gelu_tanh(g) * u

Optionally a per-row routing weight is folded in: ``h = act(g, u) * w[:, None]``.
Math runs in float32 for half types (float64 stays float64); outputs keep the input dtype.
Clamps pass the gradient where the input lies inside the closed interval, as
``torch.clamp`` does, so ties at the limit match autograd.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._checks import FLOAT_DTYPES, check_same, check_tensor

ACTIVATIONS = ("swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh")
LAYOUTS = ("halves", "interleaved")

# Integer ids let kernels and residuals carry the choice as a static int.
ACT_ID = {name: i for i, name in enumerate(ACTIVATIONS)}
LAYOUT_ID = {name: i for i, name in enumerate(LAYOUTS)}

DEFAULT_ALPHA = 1.702
DEFAULT_LIMIT = 7.0
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715
_F32_MAX = float(torch.finfo(torch.float32).max)


def resolve_activation(activation, alpha=None, limit=None) -> tuple[int, float, float]:
    """Validate an activation and its constants; return ``(act_id, alpha, limit)``.

    Constants an activation does not use are rejected rather than ignored.
    """
    if activation not in ACT_ID:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    uses_alpha = activation == "swiglu_oai"
    uses_limit = activation in ("swiglu_clamped", "swiglu_oai")
    if alpha is not None and not uses_alpha:
        raise ValueError(f"alpha is only used by 'swiglu_oai'; pass alpha=None for {activation!r}")
    if limit is not None and not uses_limit:
        raise ValueError(
            f"limit is only used by 'swiglu_clamped' and 'swiglu_oai'; pass limit=None for "
            f"{activation!r}"
        )
    for name, v in (("alpha", alpha), ("limit", limit)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"{name} must be a number (int or float) or None, got {v!r}")
    alpha = float(DEFAULT_ALPHA if alpha is None else alpha) if uses_alpha else 0.0
    limit = float(DEFAULT_LIMIT if limit is None else limit) if uses_limit else 0.0
    # The activations compute in float32 for 16- and 32-bit inputs, where a clamp refuses
    # a bound past float32's range.
    if uses_limit and not (0 < limit <= _F32_MAX):
        raise ValueError(f"limit must be a positive finite number at most {_F32_MAX:.4g} "
                         f"(float32's largest, the activations' compute precision), got {limit}")
    if uses_alpha and not abs(alpha) <= _F32_MAX:
        raise ValueError(f"alpha must be finite and at most {_F32_MAX:.4g} in magnitude "
                         f"(float32's largest, the activations' compute precision), got {alpha}")
    return ACT_ID[activation], alpha, limit


def resolve_layout(layout) -> int:
    if layout not in LAYOUT_ID:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return LAYOUT_ID[layout]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def split_packed(gate_up: torch.Tensor, layout_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the gate and up halves of a packed ``(N, 2I)`` tensor."""
    if layout_id == LAYOUT_ID["halves"]:
        i = gate_up.shape[-1] // 2
        return gate_up[..., :i], gate_up[..., i:]
    return gate_up[..., 0::2], gate_up[..., 1::2]


def join_packed(gate: torch.Tensor, up: torch.Tensor, layout_id: int) -> torch.Tensor:
    if layout_id == LAYOUT_ID["halves"]:
        return torch.cat([gate, up], dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def act_value_and_grads(g, u, act_id: int, alpha: float, limit: float, *, grads: bool):
    """``act(g, u)`` and, if ``grads``, its partial derivatives. Inputs in compute dtype."""
    if act_id == ACT_ID["swiglu"]:
        s = torch.sigmoid(g)
        silu = g * s
        if not grads:
            return silu * u, None, None
        return silu * u, u * s * (1 + g * (1 - s)), silu
    if act_id == ACT_ID["swiglu_clamped"]:
        gc = g.clamp(max=limit)
        uc = u.clamp(min=-limit, max=limit)
        s = torch.sigmoid(gc)
        silu = gc * s
        if not grads:
            return silu * uc, None, None
        dg = (uc * s * (1 + gc * (1 - s))) * (g <= limit)
        du = silu * ((u >= -limit) & (u <= limit))
        return silu * uc, dg, du
    if act_id == ACT_ID["swiglu_oai"]:
        gc = g.clamp(max=limit)
        uc = u.clamp(min=-limit, max=limit)
        t = alpha * gc
        s = torch.sigmoid(t)
        glu = gc * s
        if not grads:
            return (uc + 1) * glu, None, None
        # Where alpha * gc overflows the sigmoid is flat: its term is 0, not inf * 0.
        ts = torch.where(torch.isinf(t), 0.0, t * (1 - s))
        dg = ((uc + 1) * s * (1 + ts)) * (g <= limit)
        du = glu * ((u >= -limit) & (u <= limit))
        return (uc + 1) * glu, dg, du
    if act_id == ACT_ID["geglu_tanh"]:
        t = torch.tanh(_GELU_C * (g + _GELU_K * g * g * g))
        gelu = 0.5 * g * (1 + t)
        if not grads:
            return gelu * u, None, None
        dgelu = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _GELU_C * (1 + 3 * _GELU_K * g * g)
        return gelu * u, u * dgelu, gelu
    raise ValueError(f"unknown activation id {act_id}")


def _check_weights(weights, rows: int, ref: torch.Tensor) -> None:
    if weights is None:
        return
    check_tensor("weights", weights, ndim=1, dtypes=FLOAT_DTYPES)
    if weights.shape[0] != rows:
        raise ValueError(f"weights must have one entry per row ({rows}), got {weights.shape[0]}")
    check_same("weights and the activation input", ref, weights, dtype=False)


def check_swiglu_args(gate, up, weights) -> None:
    check_tensor("gate", gate, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("up", up, ndim=2, dtypes=FLOAT_DTYPES)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    check_same("gate and up", gate, up)
    _check_weights(weights, gate.shape[0], gate)


def check_swiglu_packed_args(gate_up, weights) -> None:
    check_tensor("gate_up", gate_up, ndim=2, dtypes=FLOAT_DTYPES)
    if gate_up.shape[-1] % 2:
        raise ValueError(
            f"gate_up must have an even last dimension (gate and up packed), "
            f"got {gate_up.shape[-1]}"
        )
    _check_weights(weights, gate_up.shape[0], gate_up)


class SwigluRes(NamedTuple):
    gate: torch.Tensor
    up: torch.Tensor
    weights: torch.Tensor | None
    act_id: int
    alpha: float
    limit: float


class SwigluPackedRes(NamedTuple):
    gate_up: torch.Tensor
    weights: torch.Tensor | None
    act_id: int
    alpha: float
    limit: float
    layout_id: int


def _forward(g, u, weights, act_id, alpha, limit, out_dtype):
    cd = compute_dtype(out_dtype)
    a, _, _ = act_value_and_grads(g.to(cd), u.to(cd), act_id, alpha, limit, grads=False)
    if weights is not None:
        a = a * weights.to(cd)[:, None]
    return a.to(out_dtype)


# h = act(g, u) * w:  dg = dh * w * da/dg,  du = dh * w * da/du,  dw = sum_j dh * act(g, u).
def _backward(g, u, weights, dh, act_id, alpha, limit, needs_w):
    cd = compute_dtype(g.dtype)
    a, da_dg, da_du = act_value_and_grads(g.to(cd), u.to(cd), act_id, alpha, limit, grads=True)
    dh = dh.to(cd)
    dw = None
    if weights is not None:
        if needs_w:
            dw = (dh * a).sum(dim=-1).to(weights.dtype)
        dh = dh * weights.to(cd)[:, None]
    return (dh * da_dg).to(g.dtype), (dh * da_du).to(u.dtype), dw


def swiglu_fwd(gate, up, weights=None, *, act_id: int, alpha: float, limit: float):
    """``h = act(gate, up) [* weights]``; gate, up ``(N, I)``, weights ``(N,)``."""
    h = _forward(gate, up, weights, act_id, alpha, limit, gate.dtype)
    return h, SwigluRes(gate, up, weights, act_id, alpha, limit)


def swiglu_bwd(res: SwigluRes, dh, *, needs=(True, True, True)):
    """Returns ``(d_gate, d_up, d_weights)``; ``d_weights`` is None without weights."""
    dg, du, dw = _backward(res.gate, res.up, res.weights, dh, res.act_id, res.alpha, res.limit,
                           needs[2])
    return (dg if needs[0] else None), (du if needs[1] else None), dw


def swiglu_packed_fwd(gate_up, weights=None, *, act_id: int, alpha: float, limit: float,
                      layout_id: int):
    """``h = act(gate, up) [* weights]`` reading both halves of ``gate_up (N, 2I)`` in place."""
    g, u = split_packed(gate_up, layout_id)
    h = _forward(g, u, weights, act_id, alpha, limit, gate_up.dtype)
    return h, SwigluPackedRes(gate_up, weights, act_id, alpha, limit, layout_id)


def swiglu_packed_bwd(res: SwigluPackedRes, dh, *, needs=(True, True)):
    """Returns ``(d_gate_up, d_weights)``, ``d_gate_up`` packed in the input's layout."""
    g, u = split_packed(res.gate_up, res.layout_id)
    dg, du, dw = _backward(g, u, res.weights, dh, res.act_id, res.alpha, res.limit, needs[1])
    dgu = join_packed(dg, du, res.layout_id) if needs[0] else None
    return dgu, dw
