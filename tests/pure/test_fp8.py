"""The FP8 rows contract (moe_fn.pure.fp8) against e4m3 built from its definition."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_fn.pure import fp8 as F


def _e4m3_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value, ascending, from its bit fields (sign, 4 exponent
    bits of bias 7, 3 mantissa bits; exponent field 0 is subnormal; S.1111.111 is NaN)."""
    vals = set()
    for e, m in itertools.product(range(16), range(8)):
        if (e, m) == (15, 7):
            continue
        v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        vals.update((v, -v))
    return torch.tensor(sorted(vals), dtype=torch.float64)


GRID = _e4m3_values()
MANTISSA = {v: i for i, v in enumerate(GRID.tolist())}


def _nearest_even(v: torch.Tensor) -> torch.Tensor:
    """Each value rounded to the e4m3 grid, ties to the even mantissa (brute force)."""
    d = (v.double()[:, None] - GRID[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    out = []
    for row, b in zip(d, best[:, 0]):
        cands = GRID[(row == b)].tolist()
        if len(cands) == 2:  # a tie: the code whose lowest mantissa bit is 0
            codes = [torch.tensor(c).to(torch.float8_e4m3fn).view(torch.uint8).item()
                     for c in cands]
            cands = [c for c, code in zip(cands, codes) if code % 2 == 0]
        out.append(cands[0])
    return torch.tensor(out, dtype=torch.float64)


def test_the_grid_is_e4m3():
    assert GRID.numel() == 2 * 127 - 1  # +0 and -0 coincide
    assert GRID.max().item() == F.FP8_MAX
    assert torch.equal(GRID.to(torch.float8_e4m3fn).double(), GRID)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 40), st.floats(-30, 30), st.integers(0, 2**31 - 1))
def test_rows_round_to_nearest_even_under_the_smallest_power_of_two_scale(n, d, log_mag, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * 2.0 ** log_mag
    if d > 2:  # midpoints and exact grid points, the cases rounding gets wrong
        x[0, 0] = 0.5 * (GRID[130] + GRID[131]) * 2.0 ** round(log_mag)
        x[0, 1] = GRID[200] * 2.0 ** round(log_mag)
    if n > 1:  # a row whose largest magnitude is exactly 448 times a power of two
        x[n - 1, 0] = -F.FP8_MAX * 2.0 ** round(log_mag)
    rows = F.quantize_rows(x)
    amax = x.abs().amax(dim=1).double()
    s = rows.scale.double()
    assert rows.q.dtype == torch.float8_e4m3fn and rows.scale.dtype == torch.float32
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
    assert bool((amax / s <= F.FP8_MAX).all()) and bool((amax / s > F.FP8_MAX / 2).all())
    want = _nearest_even((x.double() / s[:, None]).reshape(-1)).reshape(n, d)
    assert torch.equal(rows.q.double(), want)


def test_zero_and_nonfinite_rows():
    x = torch.zeros(3, 16)
    x[1, 3] = float("inf")
    x[2, 0] = float("nan")
    rows = F.quantize_rows(x)
    assert torch.equal(rows.q[0].float(), torch.zeros(16)) and rows.scale[0] > 0
    assert rows.scale[1:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantising_is_exact_and_packing_round_trips(dtype):
    x = torch.randn(7, 32, dtype=dtype) * 5
    rows = F.quantize_rows(x, torch.tensor([6, 0, 0, 3]))
    assert torch.equal(rows.q, F.quantize_rows(x[[6, 0, 0, 3]]).q)
    exact = rows.q.double() * rows.scale.double()[:, None]
    assert torch.equal(F.dequantize_rows(rows, dtype).double(), exact)
    packed = F.quantize_rows_packed(x, torch.tensor([6, 0, 0, 3]))
    assert packed.shape == (4, 32 + F.PACK_TAIL) and packed.dtype == torch.uint8
    back = F.unpack_rows_fp8(packed, 32)
    assert torch.equal(back.q.view(torch.uint8), rows.q.view(torch.uint8))
    assert torch.equal(back.scale, rows.scale)
    assert int(packed[:, 36:].abs().sum()) == 0
    with pytest.raises(ValueError, match="packed FP8 rows must be uint8"):
        F.unpack_rows_fp8(packed, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_is_the_exact_product_rounded_once(dtype):
    g = torch.Generator().manual_seed(1)
    counts = [3, 0, 5, 1]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    a = F.quantize_rows(torch.randn(9, 48, generator=g) * 3)
    b = F.quantize_weight(torch.randn(4, 16, 48, generator=g))
    got = F.fp8_grouped_mm(a, b, offs, dtype)
    # Independent: each output element's products summed by math.fsum (exact), rounded once.
    import math
    af = (a.q.double() * a.scale.double()[:, None]).tolist()
    bf = (b.q.double() * b.scale.double()[..., None]).tolist()
    want = torch.zeros(9, 16, dtype=torch.float64)
    e_of_row = [e for e, c in enumerate(counts) for _ in range(c)]
    for r, e in enumerate(e_of_row):
        for n in range(16):
            want[r, n] = math.fsum(x * y for x, y in zip(af[r], bf[e][n]))
    assert torch.equal(got, want.to(dtype))
