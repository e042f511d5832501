"""Each benchmark's result, computed once outside the timing (also under
``--benchmark-disable``), checked against its group's reference by the tolerance rule
(``moe_fn.testing``): ``plain`` is the group's plain PyTorch arm in the benchmarks' dtype,
``ref64`` the same code on the same inputs in float64. Timing stays out of it."""

from __future__ import annotations

import torch

from moe_fn.testing import assert_all_close_to_ref, assert_close_to_ref


def f64(*ts):
    """Floating tensors as float64 leaves (requiring grad where the input did); others as
    they are."""
    out = []
    for t in ts:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.detach().double().requires_grad_(t.requires_grad)
        out.append(t)
    return out if len(out) > 1 else out[0]


def check(got, plain, ref64, what: str) -> None:
    """``got`` (a tensor or a sequence of them) by the rule against ``plain`` and ``ref64``;
    an integer result must equal ``plain`` exactly."""
    if isinstance(got, torch.Tensor):
        got, plain, ref64 = [got], [plain], [ref64]
    floats = [(g, p, r) for g, p, r in zip(got, plain, ref64, strict=True)
              if g is not None and g.is_floating_point()]
    for g, p in zip(got, plain, strict=True):
        if g is not None and not g.is_floating_point():
            assert torch.equal(g, p), f"{what}: an integer result differs from plain PyTorch's"
    if len(floats) == 1:
        assert_close_to_ref(*(t.detach() for t in floats[0]), what)
    elif floats:
        assert_all_close_to_ref(*([t.detach() for t in col] for col in zip(*floats)),
                                [f"{what}[{i}]" for i in range(len(floats))])
