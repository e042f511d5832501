"""The dispatch-layout kernels against the pure ``layout``, bit for bit: counts, offs, the
stable sort and its inverse (plus ``token_of_sorted``), under the Triton interpreter on
CPU-only machines. Small ``chunk`` values cross chunk edges at interpreter-friendly sizes."""

from __future__ import annotations

import pytest
import torch

from moe_fn import kernels
from moe_fn.kernels.dispatch_layout import CHUNK, launch_layout
from moe_fn.pure.dispatch import layout

# The kernel runs on the GPU where there is one, else in the Triton interpreter (conftest).
DEV = "cuda" if torch.cuda.is_available() else "cpu"
IDX_DTYPES = [torch.int32, torch.int64]


def assert_layout(topk_idx, num_experts, chunk=None):
    """Both forms (the scan in a launch of its own, or summed by each scatter program) equal
    the pure layout bit for bit."""
    ref = layout(topk_idx, num_experts)
    for fuse_scan in (False, True):
        got = launch_layout(topk_idx.to(DEV), num_experts, chunk=chunk, fuse_scan=fuse_scan)
        assert len(got) == 5
        for name, g, r in zip(("counts", "offs", "perm", "inv_perm"), got, ref):
            assert g.dtype == r.dtype, (name, fuse_scan)
            assert torch.equal(g.cpu(), r), (name, fuse_scan)
        tok = got[4].cpu()
        assert tok.dtype == torch.int64
        assert torch.equal(tok, torch.div(ref[2], topk_idx.shape[1], rounding_mode="floor"))


def _rand(t, k, e, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, e, (t, k), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", IDX_DTYPES)
@pytest.mark.parametrize("t,k,e,chunk", [
    (37, 2, 6, 16),     # 74 rows: 5 chunks, a ragged tail, E not a power of two
    (50, 3, 60, 32),    # E = 60 > chunk: most experts get 0-2 rows of a chunk
    (9, 4, 5, None),    # 36 rows, fewer than CHUNK: one chunk of the next power of two
    (20, 2, 16, 8),     # E a power of two: tail keys (expert E) sit past every bin
    (11, 1, 3, 4),      # k = 1
    (7, 3, 1, 4),       # E = 1
    (1, 1, 1, None),    # a single row
])
def test_random_routes(dtype, t, k, e, chunk):
    assert_layout(_rand(t, k, e, dtype, seed=t * 100 + e), e, chunk)


@pytest.mark.parametrize("dtype", IDX_DTYPES)
def test_skewed_routes(dtype):
    # Every row on one expert (the others empty), then the first and last experts empty.
    assert_layout(torch.full((30, 2), 3, dtype=dtype), 5, chunk=16)
    idx = _rand(30, 2, 3, dtype, seed=1) + 1
    assert_layout(idx, 5, chunk=16)
    assert_layout(idx, 5)


def test_random_loop():
    g = torch.Generator().manual_seed(1234)
    for _ in range(8):
        t = int(torch.randint(1, 40, (), generator=g))
        k = int(torch.randint(1, 5, (), generator=g))
        e = int(torch.randint(1, 70, (), generator=g))
        chunk = 2 ** int(torch.randint(2, 6, (), generator=g))
        dtype = IDX_DTYPES[int(torch.randint(0, 2, (), generator=g))]
        # A random skew: a few experts take most rows.
        hot = torch.randint(0, e, (max(1, e // 8),), generator=g)
        idx = torch.randint(0, e, (t, k), generator=g)
        pick = torch.rand(t, k, generator=g) < 0.5
        idx = torch.where(pick, hot[torch.randint(0, hot.numel(), (t, k), generator=g)], idx)
        assert_layout(idx.to(dtype), e, chunk)


def test_default_chunk_three_chunks():
    # The shipped chunk size with a ragged third chunk (the one slow case in the interpreter).
    n = 3 * CHUNK - 37
    idx = _rand(n, 1, 60, torch.int64, seed=7)
    assert_layout(idx, 60)


def test_non_contiguous_idx():
    idx = _rand(6, 10, 7, torch.int64, seed=3).t()  # (10, 6) view with strides (1, 10)
    assert_layout(idx, 7, chunk=16)


@pytest.mark.parametrize("dtype", IDX_DTYPES)
def test_no_rows(dtype):
    for k in (1, 4):
        assert_layout(torch.zeros((0, k), dtype=dtype), 6)


def test_bad_ids_are_dropped():
    # Unchecked on CUDA: ids outside [0, E) must not make the kernel write out of bounds.
    idx = _rand(20, 2, 5, torch.int64, seed=11)
    idx[3, 1], idx[7, 0], idx[15, 1] = -1, 5, 1 << 40
    counts, offs, perm, inv_perm, _ = (x.cpu() for x in launch_layout(idx.to(DEV), 5,
                                                                      chunk=16))
    flat = idx.reshape(-1)
    ok = (flat >= 0) & (flat < 5)
    rows = ok.nonzero().squeeze(1)
    ref_perm = rows[torch.sort(flat[rows], stable=True)[1]]
    assert torch.equal(counts, torch.bincount(flat[rows], minlength=5))
    assert int(offs[-1]) == rows.numel()
    assert torch.equal(perm[:rows.numel()], ref_perm)
    assert torch.equal(inv_perm[ref_perm], torch.arange(rows.numel()))


def test_bad_chunk():
    with pytest.raises(ValueError, match="power of two"):
        launch_layout(torch.zeros((4, 2), dtype=torch.int64), 3, chunk=24)


def test_wrapper_cpu_fallback():
    idx = _rand(13, 3, 6, torch.int64, seed=5)
    ref = layout(idx, 6)
    got = kernels.layout(idx, 6)
    assert len(got) == 4
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, ref))
    got5 = kernels.layout_with_tokens(idx, 6)
    assert len(got5) == 5
    assert all(torch.equal(a, b) for a, b in zip(got5[:4], ref))
    assert torch.equal(got5[4], ref[2] // 3) and got5[4].dtype == torch.int64
    # The pure function's argument checks.
    with pytest.raises(ValueError, match="must lie in"):
        kernels.layout(idx + 1, 6)
    with pytest.raises(ValueError, match="num_experts"):
        kernels.layout_with_tokens(idx, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_wrapper_runs_kernel_on_cuda():
    idx = _rand(100, 8, 60, torch.int64, seed=9)
    ref = layout(idx, 60)
    got = kernels.layout_with_tokens(idx.cuda(), 60)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got[:4], ref))
    assert torch.equal(got[4].cpu(), ref[2] // 8)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(kernels.layout(idx.cuda(), 60), ref))
    with pytest.raises(ValueError, match="num_experts"):
        kernels.layout(idx.cuda(), 0)


def test_the_scan_is_fused_only_while_the_table_is_small(monkeypatch):
    """The launcher's default: two launches for a small (chunks x experts) table, three
    for a large one; counted by replacing the scan kernel's launch."""
    import moe_fn.kernels.dispatch_layout as dl

    scans = []

    class Probe:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                scans.append(grid)
                return dl._scan_kernel_real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(dl, "_scan_kernel_real", dl._scan_kernel, raising=False)
    monkeypatch.setattr(dl, "_scan_kernel", Probe())
    idx = _rand(40, 2, 6, torch.int64, seed=1)  # 5 chunks of 16 x 6 experts: 30 entries
    monkeypatch.setattr(dl, "_FUSED_SCAN_MAX", 30)
    assert_layout(idx, 6, chunk=16)  # (forces both forms: one scan launch)
    assert len(scans) == 1
    dl.launch_layout(idx.to(DEV), 6, chunk=16)
    assert len(scans) == 1  # 30 entries: fused
    monkeypatch.setattr(dl, "_FUSED_SCAN_MAX", 29)
    dl.launch_layout(idx.to(DEV), 6, chunk=16)
    assert len(scans) == 2  # 30 > 29: a scan launch
