"""The tolerance rule: a result's error against a float64 oracle may be at most twice the
error of plain same-precision PyTorch on the same inputs, plus one rounding step.

A fixed ``atol`` on two float32 (or bf16) summation orders holds on one CPU and fails on
the next (AVX2 vs AVX-512, one thread or two, another BLAS blocking); the error of a plain
same-precision computation of the same quantity, measured on the same machine, scales with
whatever that machine does, so a bound derived from it holds everywhere.
"""

from __future__ import annotations

import torch


def rounding_step(dtype: torch.dtype, ref64: torch.Tensor) -> float:
    """One unit of rounding of ``dtype`` at the magnitude of ``ref64`` (its max norm)."""
    if ref64.numel() == 0:
        return 0.0
    return torch.finfo(dtype).eps * ref64.abs().max().item()


def max_error(t: torch.Tensor, ref64: torch.Tensor) -> float:
    """``max |t - ref64|`` in float64 (0 for empty tensors)."""
    if t.numel() == 0:
        return 0.0
    return (t.double() - ref64.double()).abs().max().item()


def error_bound(plain: torch.Tensor, ref64: torch.Tensor, *, dtype=None) -> float:
    """What the rule allows a result of ``dtype`` (default ``plain``'s) to be off from
    ``ref64``: ``2 * max|plain - ref64| + eps(dtype) * max|ref64|``."""
    return 2 * max_error(plain, ref64) + rounding_step(dtype or plain.dtype, ref64)


def assert_close_to_ref(got: torch.Tensor, plain: torch.Tensor, ref64: torch.Tensor,
                        name: str = "") -> None:
    """Assert ``max|got - ref64| <= 2 max|plain - ref64| + eps(got.dtype) max|ref64|``.

    ``got``: the result under test; ``plain``: the same quantity computed by plain PyTorch
    in ``got``'s precision from the same inputs; ``ref64``: the float64 oracle. Shapes must
    agree, and ``got`` must not have silently changed dtype."""
    label = f"{name}: " if name else ""
    if not (got.shape == plain.shape == ref64.shape):
        raise AssertionError(f"{label}shapes differ: got {tuple(got.shape)}, plain "
                             f"{tuple(plain.shape)}, ref64 {tuple(ref64.shape)}")
    if got.dtype != plain.dtype:
        raise AssertionError(f"{label}dtypes differ: got {got.dtype}, plain {plain.dtype}")
    err, bound = max_error(got, ref64), error_bound(plain, ref64, dtype=got.dtype)
    if not err <= bound:  # also catches NaN
        raise AssertionError(
            f"{label}error against float64 {err:.3g} > bound {bound:.3g} (twice plain "
            f"{got.dtype}'s error {max_error(plain, ref64):.3g} + one rounding step "
            f"{rounding_step(got.dtype, ref64):.3g})")
