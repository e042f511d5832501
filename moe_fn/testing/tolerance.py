"""The tolerance rule: a result's error against a float64 oracle may be at most twice the
error of plain same-precision PyTorch on the same inputs, plus one rounding step.

A fixed ``atol`` on two float32 (or bf16) summation orders holds on one CPU and fails on
the next (AVX2 vs AVX-512, one thread or two, another BLAS blocking); the error of a plain
same-precision computation of the same quantity, measured on the same machine, scales with
whatever that machine does, so a bound derived from it holds everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def _require_finite(t: torch.Tensor, what: str, name: str = "") -> None:
    """Fail unless every element of ``t`` is finite, naming the tensor and the first
    offending element: a NaN or an infinity in a result, in plain's arm (which sets the
    bound) or in the oracle makes any comparison of errors meaningless."""
    bad = ~torch.isfinite(t.detach())
    if not bad.any():
        return
    flat = bad.reshape(-1)
    first = int(flat.nonzero()[0].item())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), t.shape))
    value = t.detach().reshape(-1)[first].item()
    label = f"{name}: " if name else ""
    raise AssertionError(f"{label}{what} holds {int(flat.sum())} non-finite element(s) of "
                         f"{t.numel()}, the first {value} at index {index}")


def rounding_step(dtype: torch.dtype, ref64: torch.Tensor) -> float:
    """One unit of rounding of ``dtype`` at the magnitude of ``ref64`` (its max norm).
    ``ref64`` must be finite."""
    _require_finite(ref64, "ref64")
    if ref64.numel() == 0:
        return 0.0
    return torch.finfo(dtype).eps * ref64.abs().max().item()


def max_error(t: torch.Tensor, ref64: torch.Tensor) -> float:
    """``max |t - ref64|`` in float64 (0 for empty tensors). Both must be finite: an
    error that is NaN or infinite compares as no error at all."""
    _require_finite(t, "the tensor compared")
    _require_finite(ref64, "ref64")
    if t.numel() == 0:
        return 0.0
    return (t.double() - ref64.double()).abs().max().item()


def error_bound(plain: torch.Tensor, ref64: torch.Tensor, *, dtype=None) -> float:
    """What the rule allows a result of ``dtype`` (default ``plain``'s) to be off from
    ``ref64``: ``2 * max|plain - ref64| + eps(dtype) * max|ref64|``. Both must be finite
    (an infinite bound would pass anything)."""
    _require_finite(plain, "plain")
    _require_finite(ref64, "ref64")
    return 2 * max_error(plain, ref64) + rounding_step(dtype or plain.dtype, ref64)


def _check_entry(got: torch.Tensor, plain: torch.Tensor, ref64: torch.Tensor,
                 name: str) -> None:
    """Shapes and dtypes agree and all three are finite, else fail naming the entry."""
    label = f"{name}: " if name else ""
    if not (got.shape == plain.shape == ref64.shape):
        raise AssertionError(f"{label}shapes differ: got {tuple(got.shape)}, plain "
                             f"{tuple(plain.shape)}, ref64 {tuple(ref64.shape)}")
    if got.dtype != plain.dtype:
        raise AssertionError(f"{label}dtypes differ: got {got.dtype}, plain {plain.dtype}")
    _require_finite(got, "got", name)
    _require_finite(plain, "plain", name)
    _require_finite(ref64, "ref64", name)


def _require_informative(bound: float, magnitude: float, name: str) -> None:
    """Fail when the bound reaches the oracle's magnitude: plain PyTorch is then off by half
    the result or more (a value that is rounding noise, such as a gradient that cancels to
    nearly zero, or one that rounding moves across a kink such as a clamp), and any result,
    zero included, would pass."""
    if magnitude > 0 and not bound < magnitude:
        label = f"{name}: " if name else ""
        raise AssertionError(
            f"{label}the check cannot fail: the bound {bound:.3g} reaches the float64 "
            f"magnitude {magnitude:.3g} (plain's error is half the result or more); compare "
            "this entry on inputs where it is not rounding noise and no rounding moves it "
            "across a kink (a clamp, a tie), or leave it out")


def assert_close_to_ref(got: torch.Tensor, plain: torch.Tensor, ref64: torch.Tensor,
                        name: str = "") -> None:
    """Assert ``max|got - ref64| <= 2 max|plain - ref64| + eps(got.dtype) max|ref64|``.

    ``got``: the result under test; ``plain``: the same quantity computed by plain PyTorch
    in ``got``'s precision from the same inputs; ``ref64``: the float64 oracle. Shapes must
    agree, ``got`` must not have silently changed dtype, and all three must be finite. A
    bound that reaches ``max|ref64|`` fails too: no result could."""
    label = f"{name}: " if name else ""
    _check_entry(got, plain, ref64, name)
    err, bound = max_error(got, ref64), error_bound(plain, ref64, dtype=got.dtype)
    _require_informative(bound, ref64.abs().max().item() if ref64.numel() else 0.0, name)
    if not err <= bound:
        raise AssertionError(
            f"{label}error against float64 {err:.3g} > bound {bound:.3g} (twice plain "
            f"{got.dtype}'s error {max_error(plain, ref64):.3g} + one rounding step "
            f"{rounding_step(got.dtype, ref64):.3g})")


def _triples(got: Sequence, plain: Sequence, ref64: Sequence, names: Sequence[str] | None):
    """``(got, plain, ref64, name)`` of the entries present in all three (an entry that is
    ``None`` must be ``None`` in all three); the sequences must have one length."""
    got, plain, ref64 = list(got), list(plain), list(ref64)
    names = [str(i) for i in range(len(got))] if names is None else list(names)
    if not len(got) == len(plain) == len(ref64) == len(names):
        raise AssertionError(f"lengths differ: got {len(got)}, plain {len(plain)}, ref64 "
                             f"{len(ref64)}, names {len(names)}")
    for g, p, r, n in zip(got, plain, ref64, names):
        if g is None or p is None or r is None:
            if not (g is None and p is None and r is None):
                raise AssertionError(f"{n}: None in some but not all of got {g is None}, "
                                     f"plain {p is None}, ref64 {r is None}")
            continue
        yield g, p, r, n


def assert_all_close_to_ref(got: Sequence, plain: Sequence, ref64: Sequence,
                            names: Sequence[str] | None = None) -> None:
    """:func:`assert_close_to_ref` for each triple of three sequences (outputs and gradients,
    say), each tensor against its own bound. An entry that is ``None`` (a gradient not
    wanted) must be ``None`` in all three."""
    for g, p, r, n in _triples(got, plain, ref64, names):
        assert_close_to_ref(g, p, r, n)


def assert_jointly_close_to_ref(got: Sequence, plain: Sequence, ref64: Sequence,
                                names: Sequence[str] | None = None) -> None:
    """The rule for a composite result taken as one tensor: each entry scaled by its own
    float64 magnitude (``max |ref64|``), the largest scaled error of ``got`` at most twice
    plain's plus one rounding step of the entries' dtype.

    For a whole model's outputs and gradients, where a small entry alone (a bias, a loss)
    holds too few elements for two maxima of rounding errors to be compared on every
    machine; an entry that is wrong is still off by far more than the rounding of the rest.
    ``None`` entries must be ``None`` in all three; every entry must be finite (a NaN or an
    infinity anywhere fails, naming its entry). A bound of one (plain off by half an entry's
    magnitude) or more fails too, naming that entry: no result could."""
    worst, plain_worst, plain_name, step = (0.0, ""), 0.0, "", 0.0
    for g, p, r, n in _triples(got, plain, ref64, names):
        _check_entry(g, p, r, n)
        scale = (r.abs().max().item() if r.numel() else 0.0) or 1.0  # all zero: absolute
        err = max_error(g, r) / scale
        if err > worst[0]:
            worst = (err, n)
        plain_err = max_error(p, r) / scale
        if plain_err > plain_worst:
            plain_worst, plain_name = plain_err, n
        step = max(step, torch.finfo(g.dtype).eps)
    bound = 2 * plain_worst + step
    _require_informative(bound, 1.0, plain_name)
    if not worst[0] <= bound:
        raise AssertionError(
            f"{worst[1]}: error against float64 {worst[0]:.3g} of its magnitude > bound "
            f"{bound:.3g} (twice plain's largest {plain_worst:.3g} + one rounding step "
            f"{step:.3g})")


def value_and_grads(f: Callable, inputs: Sequence, *, dtype: torch.dtype | None = None,
                    loss: Callable | None = None) -> list:
    """``[f(*inputs), d loss / d input for each input]`` by autograd, with every floating
    tensor input cast to ``dtype`` first (as it is when ``None``): run naive code once in the
    precision under test and once in float64 to get ``plain`` and ``ref64`` for the rule.

    ``loss`` maps the output to a scalar (default: the sum of squares, in float32 at least,
    so float64 stays float64); inputs that are not floating tensors (offsets, ``None``,
    Python values) pass through and get ``None`` as their gradient."""
    def prep(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.detach().to(dtype or t.dtype).requires_grad_()
        return t
    leaves = [prep(t) for t in inputs]
    y = f(*leaves)
    if loss is None:
        scalar = y.to(torch.promote_types(y.dtype, torch.float32)).square().sum()
    else:
        scalar = loss(y)
    wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    found = iter(torch.autograd.grad(scalar, wanted) if wanted else ())
    grads = [next(found) if isinstance(t, torch.Tensor) and t.requires_grad else None
             for t in leaves]
    return [y.detach(), *grads]
