"""The fused-combine gather-sum: pure pair against a naive oracle, kernel against the pure
pair under the Triton interpreter, and the custom op's checks."""

from __future__ import annotations

import pytest
import torch

from moe_fn.kernels import gather_sum as gs
from moe_fn.kernels import gather_sum_fwd as kernel_gather_sum
from moe_fn.pure.dispatch import gather_sum_bwd, gather_sum_fwd
from tests.kernels.tolerance import assert_close_to_ref

# The kernel runs on the GPU where there is one, else in the Triton interpreter (conftest).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def naive(rows, index, k):
    t = index.numel() // k
    out = torch.zeros(t, rows.shape[1], dtype=torch.float64)
    for i in range(t):
        for j in range(k):
            out[i] += rows[int(index[i * k + j])].double()
    return out


def _case(t, k, h, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(t * k, h, generator=g).to(dtype)
    index = torch.randperm(t * k, generator=g)
    return rows, index


def test_pure_pair_matches_naive_and_gradcheck():
    rows, index = _case(5, 3, 7, torch.float64)
    out, res = gather_sum_fwd(rows, index, 3)
    torch.testing.assert_close(out, naive(rows, index, 3))
    r = rows.clone().requires_grad_()
    torch.autograd.gradcheck(lambda x: gather_sum_fwd(x, index, 3)[0], (r,))
    d = torch.randn_like(out)
    (d_rows,) = gather_sum_bwd(res, d)
    r2 = rows.clone().requires_grad_()
    naive_out = torch.stack([r2[index[i * 3:(i + 1) * 3]].sum(0) for i in range(5)])
    naive_out.backward(d)
    torch.testing.assert_close(d_rows, r2.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,k,h", [(6, 2, 33), (4, 8, 70), (0, 2, 16), (3, 1, 1)])
def test_kernel_matches_pure(dtype, t, k, h):
    rows, index = _case(t, k, h, dtype, seed=t + h)
    got = gs.launch_gather_sum(rows.to(DEV), index.to(DEV), k).cpu()
    ref64 = naive(rows, index, k) if t else torch.zeros(0, h, dtype=torch.float64)
    pure, _ = gather_sum_fwd(rows, index, k)
    assert got.shape == (t, h) and got.dtype == dtype
    assert_close_to_ref(got, pure, ref64)


def test_kernel_reads_strided_rows():
    rows, index = _case(4, 2, 64, torch.float32)
    wide = torch.zeros(8, 128)
    wide[:, :64] = rows
    view = wide[:, :64]  # row stride 128
    torch.testing.assert_close(gs.launch_gather_sum(view.to(DEV), index.to(DEV), 2).cpu(),
                               gather_sum_fwd(rows, index, 2)[0])


def test_op_wrapper_and_opcheck():
    rows, index = _case(4, 2, 16, torch.float32)
    out, res = kernel_gather_sum(rows, index, 2)
    torch.testing.assert_close(out, gather_sum_fwd(rows, index, 2)[0])
    torch.library.opcheck(torch.ops.moe_fn.gather_sum.default, (rows, index, 2))
    with pytest.raises(ValueError, match="multiple of top_k"):
        torch.ops.moe_fn.gather_sum(rows, index[:7], 2)
