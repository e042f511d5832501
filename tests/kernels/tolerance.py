"""The kernel tolerance rule (DESIGN.md): a kernel's error against float64 is at most twice
the error of the same-precision pure pair, plus one step of the dtype."""

from __future__ import annotations

import torch


def assert_close_to_ref(kern, pure, ref64, name=""):
    """``|kern - ref64| <= 2 |pure - ref64| + eps(dtype) * max|ref64|`` (max norms)."""
    assert kern.shape == pure.shape == ref64.shape, name
    assert kern.dtype == pure.dtype, name
    if kern.numel() == 0:
        return
    err_k = (kern.double() - ref64).abs().max().item()
    err_p = (pure.double() - ref64).abs().max().item()
    step = torch.finfo(kern.dtype).eps * ref64.abs().max().item()
    assert err_k <= 2 * err_p + step, f"{name}: kernel err {err_k} > 2 * {err_p} + {step}"
