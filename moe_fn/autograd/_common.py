"""Helpers every shell shares."""

from __future__ import annotations

import torch


def refuse_double_backward(name: str) -> None:
    """moe_fn backward passes are first order: say so instead of returning wrong results."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}: moe_fn's backward is first-order only; create_graph=True / double "
            "backward is not supported"
        )


def contiguous_grad(g):
    """Incoming gradients may be non-contiguous or zero-stride (``y.sum().backward()``)."""
    return None if g is None else g.contiguous()
