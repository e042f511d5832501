"""The FP8 row kernels against ``moe_fn.pure.fp8``, bit for bit, on the CPU under
TRITON_INTERPRET=1: the e4m3 rounding against torch's cast, quantise (plain, through an
index, packed) and dequantise against the pure functions, and the activation kernels with
their quantisation fused in against quantising what the bf16 kernels write.

NaN bytes are compared as one value: a row holding inf or NaN has a NaN scale and NaN
bytes, whose sign in the pure path is the CPU's NaN propagation (``-nan / s`` keeps the
sign on x86, a GPU writes its canonical NaN), not part of the contract.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import moe_fn.kernels as ops  # noqa: E402
from moe_fn.kernels import activation as KA  # noqa: E402
from moe_fn.kernels import fp8 as KF  # noqa: E402
from moe_fn.kernels.fp8 import _e4m3_bytes, _round_e4m3  # noqa: E402
from moe_fn.pure import activations as PA  # noqa: E402
from moe_fn.pure import fp8 as PF  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

FP8 = torch.float8_e4m3fn
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _interp_required():
    if not KA.interpreting():
        pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 before triton is imported")


def _bytes(q):
    b = q.contiguous().view(torch.uint8).to(torch.int16)
    return torch.where((b & 0x7F) == 0x7F, 0x7F, b)


def assert_same_rows(got, want):
    assert got.q.dtype == FP8 and got.scale.dtype == torch.float32
    assert got.q.shape == want.q.shape and got.scale.shape == want.scale.shape
    assert got.q.is_contiguous() and got.scale.is_contiguous()
    assert torch.equal(got.scale.view(torch.int32), want.scale.view(torch.int32)), "scale"
    assert torch.equal(_bytes(got.q), _bytes(want.q)), "q"


def assert_same_packed(got, want):
    """Packed FP8 rows: the e4m3 bytes as ``assert_same_rows``, the scale and tail bytes
    exactly."""
    d = want.shape[1] - PF.PACK_TAIL
    assert got.dtype == torch.uint8 and got.shape == want.shape
    assert torch.equal(got[:, d:], want[:, d:]), "scale and tail"
    assert torch.equal(_bytes(got[:, :d].view(FP8)), _bytes(want[:, :d].view(FP8))), "q"


def assert_same_bits(a, b):
    """Same dtype, shape and bits, NaNs of any payload counted equal."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
    if a.dtype.is_floating_point:  # signed zeros
        assert torch.equal(a.signbit() | a.isnan(), b.signbit() | b.isnan())


# ----------------------------------------------------------------------------- rounding


@triton.jit
def _round_kernel(v_ptr, r_ptr, b_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    v = tl.load(v_ptr + o, mask=m, other=0.0)
    tl.store(r_ptr + o, _round_e4m3(v), mask=m)
    tl.store(b_ptr + o, _e4m3_bytes(v, v != v), mask=m)


def _rounding_cases() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours (exact in float32), the
    float32 neighbours of both, values past 448, zeros, float32 subnormals, infinities, and
    random values in the normal and the subnormal range."""
    e4 = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(FP8).float()
    e4 = e4[e4.isfinite() & (e4 >= 0)].unique().sort().values.double()
    mids = (e4[1:] + e4[:-1]) / 2
    special = torch.tensor([0.0, 448.0, 449.0, 464.0, 479.99, 480.0, 512.0, 1e30, 3.4e38,
                            float("inf"), 2.0 ** -10, 2.0 ** -6, 1e-40, 1.4e-45],
                           dtype=torch.float64)
    base = torch.cat([e4, mids, special]).float()
    bits = base.view(torch.int32)
    near = torch.cat([(bits + d).clamp(0, 0x7F800000) for d in range(-3, 4)]).view(
        torch.float32)
    gen = torch.Generator().manual_seed(0)
    normal = torch.exp2(torch.rand(60000, generator=gen) * 16 - 7)  # [2**-7, 2**9)
    sub = torch.rand(20000, generator=gen) * 2.0 ** -6
    mag = torch.cat([near, normal, sub])
    return torch.cat([mag, -mag])


def test_rounding_matches_torch_cast():
    """``_round_e4m3`` is ``v.clamp(-448, 448).to(float8_e4m3fn)`` as a float32 (round to
    nearest even, the subnormal grid, saturation, signed zeros) and ``_e4m3_bytes`` its
    bytes, with e4m3's NaN for NaN: whatever the backend's own rounding cast does."""
    _interp_required()
    v = torch.cat([_rounding_cases(), torch.tensor([float("nan"), -float("nan")])])
    r = torch.empty_like(v)
    b = torch.empty(v.shape, dtype=torch.uint8)
    _round_kernel[(triton.cdiv(v.numel(), 8192),)](v, r, b, v.numel(), BLOCK=8192)
    want = v.clamp(-448.0, 448.0).to(FP8)
    fin = ~v.isnan()
    assert torch.equal(r[fin].view(torch.int32), want[fin].float().view(torch.int32))
    assert torch.equal(b[fin], want[fin].view(torch.uint8))
    assert bool((b[~fin] == 0x7F).all())


# ----------------------------------------------------------------------------- quantise


def _rows(n, d, dtype, seed=0):
    """Rows whose magnitudes span many binades, with a row of zeros, a signed zero and a
    row of float32 subnormals (float32 only), exact ties and the largest finite value."""
    gen = torch.Generator().manual_seed(seed)
    span = 8 if dtype == torch.float16 else 20
    x = torch.randn(n, d, generator=gen) * torch.exp2(torch.randint(-span, span, (n, 1),
                                                                    generator=gen).float())
    x[0] = 0.0
    x[1:3] = torch.linspace(-50.0, 50.0, d)
    x[1, :2] = torch.tensor([-0.0, 56.0])  # amax 1.75 * 2**5: q reaches 448 exactly
    x[2, 0] = 57.0  # just past that boundary: the next scale
    x = x.to(dtype)
    if dtype == torch.float32:
        x[3] = torch.randn(d, generator=gen) * 1e-40
        x[4, 1] = torch.finfo(torch.float32).max
    return x


def _nonfinite(x):
    x = x.clone()
    x[5, 3] = float("nan")
    x[6, 0] = -float("inf")
    x[7, -1] = -float("nan")
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_matches_pure(dtype):
    _interp_required()
    x = _nonfinite(_rows(13, 80, dtype))
    assert_same_rows(KF.launch_quantize_rows(x), PF.quantize_rows(x))
    idx = torch.tensor([12, 0, 5, 5, 3, 7, 1, 2, 4, 11, 6])
    assert_same_rows(KF.launch_quantize_rows(x, idx), PF.quantize_rows(x, idx))
    assert_same_rows(KF.launch_quantize_rows(x, idx.int()), PF.quantize_rows(x, idx))


def test_quantize_rows_scale_boundaries():
    """The scale of amax values on and next to each power-of-two boundary (448 * 2**k and
    1.75 * 2**E, their float32 neighbours), tiny and huge ones, zero and the floor."""
    _interp_required()
    amax = []
    for e in (-70, -64, -40, -6, 0, 1, 8, 9, 40, 119, 126):
        for m in (1.0, 1.75, 1.5):
            v = torch.tensor([m * 2.0 ** e], dtype=torch.float64).float()
            b = v.view(torch.int32)
            amax += [(b + d).view(torch.float32) for d in (-1, 0, 1)]
    amax = torch.cat(amax + [torch.tensor([0.0, 1e-45, 3.4028235e38])])
    x = torch.stack([amax, -amax * 0.5, amax * 0.25], dim=1)
    got = KF.launch_quantize_rows(x)
    assert torch.equal(got.scale.view(torch.int32), PF.pow2_scale(amax).view(torch.int32))
    assert_same_rows(got, PF.quantize_rows(x))


def test_quantize_rows_any_layout_and_config():
    """Strided sources (a transpose, a row slice), widths past and below one column block,
    and other block shapes than the default all give the same bits."""
    _interp_required()
    x = _nonfinite(_rows(11, 70, torch.bfloat16, seed=1))
    want = PF.quantize_rows(x)
    assert_same_rows(KF.launch_quantize_rows(x.t().contiguous().t()), want)
    wide = torch.zeros(11, 90, dtype=x.dtype)
    wide[:, 7:77] = x
    assert_same_rows(KF.launch_quantize_rows(wide[:, 7:77]), want)
    for block_r, block_c in ((1, 16), (8, 128), (2, 64)):
        assert_same_rows(KF.launch_quantize_rows(x, block_r=block_r, block_c=block_c), want)
    for d in (1, 5, 33):
        xs = x[:, :d].contiguous()
        assert_same_rows(KF.launch_quantize_rows(xs), PF.quantize_rows(xs))


def test_quantize_rows_packed_matches_pure():
    """Packed rows: e4m3 bytes, the scale's bytes and a zero tail, every byte written
    (``out`` starts as 0xFF), through an index or not."""
    _interp_required()
    x = _nonfinite(_rows(9, 48, torch.float32, seed=2))
    for idx in (None, torch.tensor([8, 8, 0, 3, 5, 6, 7])):
        want = PF.quantize_rows_packed(x, idx)
        n = want.shape[0]
        out = torch.full((n, 64), 0xFF, dtype=torch.uint8)
        got = KF.launch_quantize_rows_packed(x, idx, out=out)
        assert got is out
        assert_same_packed(got, want)
        assert_same_packed(KF.launch_quantize_rows_packed(x, idx, block_c=16), want)
    assert KF.launch_quantize_rows_packed(x[:, :0].contiguous()).tolist() == \
        PF.quantize_rows_packed(x[:, :0]).tolist()


def test_quantize_rows_t_matches_pure():
    """Expert weights transposed and quantised in one pass: the bits of quantising the
    transposed copy row by row, for non-finite entries, widths past and below a tile,
    strided sources and other tile shapes."""
    _interp_required()
    for dtype in DTYPES:
        w = _nonfinite(_rows(3 * 13, 70, dtype, seed=4)).reshape(3, 13, 70)
        want = PF.quantize_rows(w.transpose(1, 2).reshape(3 * 70, 13))
        want = PF.Fp8Rows(want.q.reshape(3, 70, 13), want.scale.reshape(3, 70))
        assert_same_rows(KF.launch_quantize_rows_t(w), want)
        assert_same_rows(PF.quantize_rows_t(w), want)
        assert_same_rows(ops.quantize_rows_t(w), want)  # the CPU op: the pure function
    w = _rows(2 * 40, 9, torch.bfloat16, seed=5).reshape(2, 40, 9)
    want = PF.quantize_rows_t(w)
    assert_same_rows(KF.launch_quantize_rows_t(w.transpose(1, 2).contiguous().transpose(1, 2)),
                     want)
    for block_k, block_n in ((1, 16), (16, 8), (8, 64)):
        assert_same_rows(KF.launch_quantize_rows_t(w, block_k=block_k, block_n=block_n), want)
    empty = KF.launch_quantize_rows_t(w[:, :0])
    assert empty.q.shape == (2, 9, 0) and empty.scale.shape == (2, 9)
    with pytest.raises(ValueError, match="3-D"):
        ops.quantize_rows_t(w[0])


def test_quantize_rows_empty():
    _interp_required()
    x = torch.randn(0, 32)
    got = KF.launch_quantize_rows(x)
    assert got.q.shape == (0, 32) and got.scale.shape == (0,)
    assert KF.launch_quantize_rows_packed(x).shape == (0, 48)
    x = torch.randn(4, 0)
    assert_same_rows(KF.launch_quantize_rows(x), PF.quantize_rows(x))


# ----------------------------------------------------------------------------- dequantise


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_rows_matches_pure(dtype):
    """Every e4m3 byte under small, unit, large and NaN scales; q read through a view of
    packed rows too."""
    _interp_required()
    q = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(FP8).reshape(8, 32)
    q = torch.cat([q, q.flip(0)])
    scale = torch.tensor([2.0 ** -72, 2.0 ** -9, 1.0, 2.0 ** 7, 2.0 ** 16, 2.0 ** 120,
                          float("nan"), 0.5] * 2)
    rows = PF.Fp8Rows(q, scale)
    assert_same_bits(KF.launch_dequantize_rows(rows, dtype), PF.dequantize_rows(rows, dtype))
    x = _rows(7, 64, torch.float32, seed=3)
    packed = PF.quantize_rows_packed(x)
    view = PF.unpack_rows_fp8(packed, 64)
    assert view.q.stride(0) == 80
    assert_same_bits(KF.launch_dequantize_rows(view, dtype), PF.dequantize_rows(view, dtype))
    assert_same_bits(KF.launch_dequantize_rows(view, dtype, block_c=16),
                     PF.dequantize_rows(view, dtype))


# ----------------------------------------------------------------------------- activation


def _consts(act):
    return PA.resolve_activation(act, limit=2.0 if act in ("swiglu_clamped", "swiglu_oai")
                                 else None)


def _act_inputs(n, i, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gu = torch.randn(n, 2 * i, generator=gen) * 3
    gu[1] = 0.0  # a row of zeros: h = 0 and d_gate_up = 0
    gu[2] *= 40.0  # larger than its neighbours: another scale
    w = torch.rand(n, generator=gen) + 0.25
    dh = torch.randn(n, i, generator=gen)
    return gu.to(dtype), w.to(dtype), dh.to(dtype)


def _make(gu, form):
    if form == "rowslice":
        big = torch.zeros(gu.shape[0], gu.shape[1] + 5, dtype=gu.dtype)
        big[:, 2:2 + gu.shape[1]] = gu
        return big[:, 2:2 + gu.shape[1]]
    if form == "transposed":
        return gu.t().contiguous().t()
    return gu


def _check_act_fp8(gu, w, dh, act, layout_id, need_w=True, rereads=(False, True)):
    """The fused kernels' FP8 rows are quantize_rows of what the bf16 kernels write; the
    backward's d_gate_up and d_weights are the bf16 kernel's bits."""
    act_id, alpha, limit = _consts(act)
    h = KA.launch_swiglu_packed_fwd(gu, w, act_id, alpha, limit, layout_id)
    assert_same_rows(KA.launch_swiglu_packed_fwd_fp8(gu, w, act_id, alpha, limit, layout_id),
                     PF.quantize_rows(h))
    dgu, dw = KA.launch_swiglu_packed_bwd(gu, w, dh, act_id, alpha, limit, layout_id,
                                          (True, need_w))
    for reread in rereads:  # the second pass recomputes, or reads back d_gate_up
        dgu8, rows, dw8 = KA.launch_swiglu_packed_bwd_fp8(gu, w, dh, act_id, alpha, limit,
                                                          layout_id, need_w, reread=reread)
        assert dgu8.is_contiguous()
        assert_same_bits(dgu8, dgu)
        assert_same_rows(rows, PF.quantize_rows(dgu))
        assert (dw8 is None) == (dw is None)
        if dw is not None:
            assert_same_bits(dw8, dw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", PA.ACTIVATIONS)
@pytest.mark.parametrize("layout", PA.LAYOUTS)
@pytest.mark.parametrize("with_w", [False, True])
def test_activation_fp8_matches_quantized_kernel_output(dtype, act, layout, with_w):
    """Odd N (13), I = 37 (not a power of two, past one column block). The backward's
    read-back pass does not depend on the activation: two of them check it."""
    _interp_required()
    gu, w, dh = _act_inputs(13, 37, dtype)
    _check_act_fp8(gu, w if with_w else None, dh, act, PA.resolve_layout(layout),
                   rereads=(False, True) if act in ("swiglu", "swiglu_oai") else (False,))


@pytest.mark.parametrize("layout", PA.LAYOUTS)
@pytest.mark.parametrize("form", ["rowslice", "transposed"])
def test_activation_fp8_strided_inputs(layout, form):
    """Row-sliced and column-strided gate_up (the unpaired interleaved reads), a
    column-strided dh, d_weights not wanted."""
    _interp_required()
    gu, w, dh = _act_inputs(9, 21, torch.bfloat16, seed=1)
    _check_act_fp8(_make(gu, form), w, dh.t().contiguous().t(), "swiglu_oai",
                   PA.resolve_layout(layout), need_w=form == "rowslice")


def test_activation_fp8_nonfinite_and_empty():
    """A row with inf gets a NaN scale and NaN bytes; empty row sets and zero widths give
    the shapes (and the zero row's scale) of the pure functions."""
    _interp_required()
    gu, w, dh = _act_inputs(6, 20, torch.bfloat16, seed=2)
    gu[3, 4] = float("inf")
    gu[4, 30] = float("nan")
    for layout_id in (0, 1):
        _check_act_fp8(gu, w, dh, "swiglu", layout_id)
        r = KA.launch_swiglu_packed_fwd_fp8(gu, w, 0, 0.0, 0.0, layout_id)
        assert r.scale[3:5].isnan().all() and r.scale[:3].isfinite().all()
    for n, i in ((0, 8), (5, 0)):
        gu, w, dh = _act_inputs(max(n, 3), max(i, 1), torch.bfloat16)
        gu, w, dh = gu[:n, :2 * i], w[:n], dh[:n, :i]
        for layout_id in (0, 1):
            _check_act_fp8(gu, w, dh, "swiglu", layout_id)
            want, _ = PF.swiglu_packed_fwd_fp8(gu, w, act_id=0, alpha=0.0, limit=0.0,
                                               layout_id=layout_id)
            assert_same_rows(KA.launch_swiglu_packed_fwd_fp8(gu, w, 0, 0.0, 0.0, layout_id),
                             want)


# ----------------------------------------------------------------------------- the ops


@pytest.mark.parametrize("act", PA.ACTIVATIONS)
@pytest.mark.parametrize("layout", PA.LAYOUTS)
def test_cpu_path_is_the_pure_composition(act, layout):
    """On CPU tensors the wrappers are the pure twins: quantize_rows of the pure
    activation's output and of its d_gate_up, with the pure d_weights."""
    act_id, alpha, limit = _consts(act)
    layout_id = PA.resolve_layout(layout)
    gu, w, dh = _act_inputs(7, 6, torch.bfloat16, seed=4)
    kw = dict(act_id=act_id, alpha=alpha, limit=limit, layout_id=layout_id)
    rows, res = ops.swiglu_packed_fwd_fp8(gu, w, **kw)
    h, pres = PA.swiglu_packed_fwd(gu, w, **kw)
    assert type(res) is type(pres) and res.gate_up is gu and res.weights is w
    assert res[2:] == pres[2:]
    assert_same_rows(rows, PF.quantize_rows(h))
    dgu, drows, dw = ops.swiglu_packed_bwd_fp8(res, dh)
    pdgu, pdw = PA.swiglu_packed_bwd(pres, dh)
    assert torch.equal(dgu, pdgu) and torch.equal(dw, pdw)
    assert_same_rows(drows, PF.quantize_rows(pdgu))
    assert ops.swiglu_packed_bwd_fp8(res, dh, needs=(True, False))[2] is None
    assert ops.swiglu_packed_bwd_fp8(res._replace(weights=None), dh)[2] is None


def test_cpu_path_rows():
    x = _nonfinite(_rows(9, 32, torch.bfloat16, seed=5))
    idx = torch.tensor([3, 1, 8])
    assert_same_rows(ops.quantize_rows(x, idx), PF.quantize_rows(x, idx))
    assert_same_packed(ops.quantize_rows_packed(x, idx), PF.quantize_rows_packed(x, idx))
    rows = PF.quantize_rows(x)
    for dtype in (torch.bfloat16, torch.float64):
        assert_same_bits(ops.dequantize_rows(rows, dtype), PF.dequantize_rows(rows, dtype))


def test_bad_input_is_refused_with_the_fix():
    x = torch.randn(4, 24)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        ops.quantize_rows(x.double())
    with pytest.raises(ValueError, match="2-D"):
        ops.quantize_rows(x[0])
    with pytest.raises(ValueError, match=r"D % 16 == 0.*got D = 24"):
        ops.quantize_rows_packed(x)
    with pytest.raises(ValueError, match=r"index values must lie in \[0, 4\)"):
        ops.quantize_rows(x, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"index values must lie in \[0, 4\)"):
        ops.quantize_rows_packed(x[:, :16].contiguous(), torch.tensor([-1]))
    with pytest.raises(TypeError, match="int32 or int64"):
        ops.quantize_rows(x, torch.tensor([0.0]))
    rows = ops.quantize_rows(x)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        ops.dequantize_rows(PF.Fp8Rows(x, rows.scale), torch.float32)
    with pytest.raises(TypeError, match=r"float32 of shape \(4,\)"):
        ops.dequantize_rows(PF.Fp8Rows(rows.q, rows.scale[:3]), torch.float32)
    with pytest.raises(TypeError, match="floating torch.dtype"):
        ops.dequantize_rows(rows, torch.int32)
    gu, w, dh = _act_inputs(4, 3, torch.float32)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        ops.swiglu_packed_fwd_fp8(gu.double(), None, act_id=0, alpha=0.0, limit=0.0,
                                  layout_id=0)
    _, res = ops.swiglu_packed_fwd_fp8(gu, w, act_id=0, alpha=0.0, limit=0.0, layout_id=0)
    with pytest.raises(ValueError, match=r"needs=\(False, True\)"):
        ops.swiglu_packed_bwd_fp8(res, dh, needs=(False, True))
    with pytest.raises(ValueError, match="incoming gradient"):
        ops.swiglu_packed_bwd_fp8(res, dh[:, :2])
    if KA.interpreting():
        with pytest.raises(ValueError, match="D % 16 == 0"):
            KF.launch_quantize_rows_packed(x)
        with pytest.raises(ValueError, match=r"contiguous uint8 \(4, 32\)"):
            KF.launch_quantize_rows_packed(x[:, :16], out=torch.empty(4, 33, dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_match_pure():
    torch.manual_seed(0)
    x = (torch.randn(1031, 2048, device="cuda") * 4).bfloat16()
    x[3, 5] = float("nan")
    idx = torch.randint(0, 1031, (777,), device="cuda")
    assert_same_rows(ops.quantize_rows(x, idx), PF.quantize_rows(x, idx))
    assert_same_packed(ops.quantize_rows_packed(x, idx), PF.quantize_rows_packed(x, idx))
    wt = (torch.randn(6, 1536, 2048, device="cuda") * 2).bfloat16()
    wt[2, 7, 9] = float("inf")
    assert_same_rows(ops.quantize_rows_t(wt), PF.quantize_rows_t(wt))
    assert_same_rows(ops.quantize_rows_t(wt[:, :, :768]), PF.quantize_rows_t(wt[:, :, :768]))
    rows = PF.quantize_rows(x)
    assert_same_bits(ops.dequantize_rows(rows, torch.bfloat16),
                     PF.dequantize_rows(rows, torch.bfloat16))
    gu = (torch.randn(1031, 2 * 768, device="cuda") * 3).bfloat16()
    w = torch.rand(1031, device="cuda").bfloat16()
    dh = torch.randn(1031, 768, device="cuda").bfloat16()
    for layout_id in (0, 1):
        kw = dict(act_id=2, alpha=1.702, limit=7.0, layout_id=layout_id)
        h, res = ops.swiglu_packed_fwd(gu, w, **kw)
        assert_same_rows(ops.swiglu_packed_fwd_fp8(gu, w, **kw)[0], PF.quantize_rows(h))
        dgu, dw = ops.swiglu_packed_bwd(res, dh)
        dgu8, drows, dw8 = ops.swiglu_packed_bwd_fp8(res, dh)
        assert torch.equal(dgu8, dgu)
        assert_same_rows(drows, PF.quantize_rows(dgu8))
        torch.testing.assert_close(dw8, dw)
