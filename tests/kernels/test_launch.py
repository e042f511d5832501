"""The fast Triton launch path (``moe_fn.kernels._launch``): its cache key separates every
specialisation Triton compiles separately, repeat launches pass the launcher the same
arguments Triton would, and every case it does not cover takes Triton's own path.

On the CPU a fake kernel stands in for Triton (there is no compiled launcher there); on a
GPU the real kernels run through both paths and must agree."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moe_fn.kernels import _launch


class FakeCompiled:
    """A compiled kernel: ``run`` records what the launcher receives."""

    def __init__(self, log):
        self.log = log
        self.function = object()
        self.packed_metadata = ("meta",)

    def run(self, *a):
        self.log.append(("fast", a))


class FakeKernel:
    """A JIT function: ``kernel[grid](...)`` compiles (logged) and returns FakeCompiled."""

    arg_names = ["x", "y", "n", "BLOCK"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def call(*args, **params):
            self.log.append(("slow", grid, args, params))
            return FakeCompiled(self.log)
        return call


class FakeConfig:
    pre_hook = None

    def __init__(self, **kw):
        self.kw = kw

    def all_kwargs(self):
        return dict(self.kw)


class FakeTuner(FakeKernel):
    """An autotuner: ``configs``, ``fn`` (the JIT function) and the ``best_config`` of its
    last run."""

    configs = [FakeConfig(BLOCK=64, num_warps=4), FakeConfig(BLOCK=128, num_warps=8)]

    def __init__(self):
        super().__init__()
        self.fn = FakeKernel()
        self.best_config = None

    def __getitem__(self, grid):
        inner = super().__getitem__(grid)

        def call(*args, **params):
            self.best_config = self.configs[-1]
            return inner(*args, **params, **self.best_config.all_kwargs())
        return call


@pytest.fixture
def fake_cuda(monkeypatch):
    """The launcher's view of a CUDA device, on the CPU."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    monkeypatch.setattr(_launch, "_CACHE", {})
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(_launch, "_jit_types", lambda: (FakeKernel,))


def kinds(log):
    return [e[0] for e in log]


def test_repeat_launch_calls_the_launcher_with_triton_s_argument_list(fake_cuda):
    k = FakeKernel()
    x, y = torch.zeros(64), torch.zeros(64)
    _launch.launch(k, (3,), x, y, 7, BLOCK=32, num_warps=4)
    _launch.launch(k, (5, 2), x, y, 7, BLOCK=32, num_warps=4)
    assert kinds(k.log) == ["slow", "fast"]
    grid0, grid1, grid2, stream, function, packed, meta, enter, leave, *args = k.log[1][1]
    assert (grid0, grid1, grid2, stream) == (5, 2, 1, 1234)
    assert packed == ("meta",) and meta is None and enter is None and leave is None
    # Every parameter in signature order, the constexpr included (not launch options).
    assert args[:2] == [x, y] and args[2:] == [7, 32]


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int_one", "int_div16", "int64",
                                    "constexpr", "constexpr_type", "option", "none", "debug"])
def test_each_specialisation_triton_separates_compiles_again(fake_cuda, monkeypatch, change):
    k = FakeKernel()
    base = torch.zeros(64)
    args = {"x": base, "y": base, "n": 48}
    params = {"BLOCK": 32, "num_warps": 4}
    _launch.launch(k, (1,), *args.values(), **params)
    if change == "misaligned":
        args["x"] = base[1:]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args["y"] = base.double()
    elif change == "int_one":
        args["n"] = 1
    elif change == "int_div16":
        args["n"] = 47
    elif change == "int64":
        args["n"] = 2**31 + 16
    elif change == "constexpr":
        params["BLOCK"] = 64
    elif change == "constexpr_type":  # Triton compiles 32 and 32.0 separately
        params["BLOCK"] = 32.0
    elif change == "debug":
        monkeypatch.setattr(_launch, "_knob_state", lambda: (True, None))
    elif change == "option":
        params["num_warps"] = 8
    elif change == "none":
        args["y"] = None
    _launch.launch(k, (1,), *args.values(), **params)
    assert kinds(k.log) == ["slow", "slow"]
    _launch.launch(k, (1,), *args.values(), **params)
    assert kinds(k.log) == ["slow", "slow", "fast"]


def test_same_properties_share_a_compiled_kernel(fake_cuda):
    k = FakeKernel()
    a, b = torch.zeros(64), torch.zeros(128)
    _launch.launch(k, (1,), a, a, 32, BLOCK=32)
    _launch.launch(k, (1,), b[4:], b, 64, BLOCK=32)  # 16 bytes in: still aligned
    assert kinds(k.log) == ["slow", "fast"]


def test_hooks_unkeyed_arguments_and_disabling_take_triton_s_path(fake_cuda, monkeypatch):
    k = FakeKernel()
    x = torch.zeros(8)
    _launch.launch(k, (1,), x, x, 3, BLOCK=8)
    _launch.launch(k, (1,), x, x, (3,), BLOCK=8)  # a tuple argument: not keyed here
    monkeypatch.setattr(_launch, "_hooks_set", lambda: True)
    _launch.launch(k, (1,), x, x, 3, BLOCK=8)
    monkeypatch.setattr(_launch, "_hooks_set", lambda: False)
    monkeypatch.setattr(_launch, "ENABLED", False)
    _launch.launch(k, (1,), x, x, 3, BLOCK=8)
    assert kinds(k.log) == ["slow"] * 4


def test_wrappers_and_pre_run_hooks_keep_triton_s_path(fake_cuda, monkeypatch):
    k = FakeKernel()
    x = torch.zeros(8)
    monkeypatch.setattr(_launch, "_jit_types", lambda: ())  # e.g. triton.heuristics
    for _ in range(2):
        _launch.launch(k, (1,), x, x, 3, BLOCK=8)
    assert kinds(k.log) == ["slow", "slow"]
    monkeypatch.setattr(_launch, "_jit_types", lambda: (FakeKernel,))
    _launch.launch(k, (1,), x, x, 16, BLOCK=8)  # another key: an entry this time
    _launch.launch(k, (1,), x, x, 16, BLOCK=8)
    assert kinds(k.log)[-1] == "fast"
    k.pre_run_hooks = [print]  # added after the entry was made
    _launch.launch(k, (1,), x, x, 16, BLOCK=8)
    assert kinds(k.log)[-1] == "slow"


def test_a_callable_grid_sees_runtime_arguments_by_name(fake_cuda):
    k = FakeKernel()
    x = torch.zeros(8)
    for _ in range(2):
        _launch.launch(k, lambda m: (m["n"] // m["BLOCK"],), x, x, 64, BLOCK=8)
    assert kinds(k.log) == ["slow", "fast"]
    assert k.log[1][1][0] == 8


def test_a_parameter_left_to_its_default_is_never_launched_fast(fake_cuda):
    k = FakeKernel()
    x = torch.zeros(8)
    for _ in range(3):
        _launch.launch(k, (1,), x, x, 3)  # BLOCK not passed: the tail is unknown
    assert kinds(k.log) == ["slow"] * 3


def test_a_parameter_left_to_its_declared_default_is_launched_fast_with_it(fake_cuda):
    import inspect
    import types

    k = FakeKernel()
    k.params = [types.SimpleNamespace(name=n, default=inspect.Parameter.empty)
                for n in ("x", "y", "n")] + [types.SimpleNamespace(name="BLOCK", default=16)]
    x = torch.zeros(8)
    for _ in range(2):
        _launch.launch(k, (1,), x, x, 3)
    assert kinds(k.log) == ["slow", "fast"]
    assert k.log[1][1][-1] == 16  # the tail Triton would bind: BLOCK's default


def test_the_router_kernel_launches_fast_without_its_linear_flags():
    """The router kernel's fused-linear constexprs have defaults the plain router launch
    leaves out; the fast path must still take that launch (binding the defaults as Triton
    does), not send it down Triton's path."""
    import types

    from triton.runtime.jit import JITFunction

    from moe_fn.kernels.router import _router_fwd_kernel as kernel

    if not isinstance(kernel, JITFunction):  # the interpreter's wrapper: the JIT function
        kernel = JITFunction(kernel.fn)
    compiled = types.SimpleNamespace(run=lambda *a: None, function=object(),
                                     packed_metadata=())
    plain = dict(K=4, KP=4, SCORE=0, HAS_BIAS=False, NORM=True, PRECISE=True, N_GROUP=1,
                 TOPK_GROUP=1, TOP2=True, BLOCK_T=32, BLOCK_E=128, num_warps=4)
    n_args = kernel.arg_names.index("K")
    entry = _launch._entry(kernel, compiled, n_args, plain)
    assert entry is not None
    tail = dict(zip(kernel.arg_names[n_args:], entry[3]))
    assert tail["LINEAR"] is False and tail["REPLAY"] is False and tail["K"] == 4


def test_interpreter_or_no_compiled_kernel_stays_on_triton_s_path(fake_cuda):
    k = FakeKernel()
    k.__class__ = type("Interp", (FakeKernel,), {
        "__getitem__": lambda self, g: lambda *a, **p: self.log.append(("slow",))})
    x = torch.zeros(8)
    for _ in range(3):
        _launch.launch(k, (1,), x, x, 3, BLOCK=8)
    assert kinds(k.log) == ["slow"] * 3


def test_autotuned_kernel_replays_the_chosen_config_per_tune_key(fake_cuda):
    k = FakeTuner()
    x = torch.zeros(64)

    def grid(m):
        return (1000 // m["BLOCK"],)
    _launch.launch(k, grid, x, x, 32, tune_key=(32,), FLAG=True)
    _launch.launch(k, grid, x, x, 32, tune_key=(32,), FLAG=True)
    assert kinds(k.log) == ["slow", "fast"]
    g0, *_rest = k.log[1][1]
    args = k.log[1][1][9:]
    assert g0 == 1000 // 128  # the grid from the config the tuner chose
    assert args[3:] == (128,)  # its constexpr in the launcher's argument list
    _launch.launch(k, grid, x, x, 32, tune_key=(48,), FLAG=True)  # another tuning key
    assert kinds(k.log)[-1] == "slow"


def test_an_autotuner_config_with_a_pre_hook_is_never_launched_fast(fake_cuda):
    k = FakeTuner()
    hooked = FakeConfig(BLOCK=128, num_warps=8)
    hooked.pre_hook = print
    k.configs = [hooked]
    x = torch.zeros(64)
    for _ in range(2):
        _launch.launch(k, lambda m: (1,), x, x, 32, FLAG=True)
    assert kinds(k.log) == ["slow", "slow"]


@pytest.mark.parametrize("value, enabled", [("0", False), ("", False), ("false", False),
                                            ("Off", False), ("1", True)])
def test_environment_switch(value, enabled):
    env = dict(os.environ, MOE_FN_FAST_LAUNCH=value)
    out = subprocess.run([sys.executable, "-c", "from moe_fn.kernels import _launch; "
                          "print(_launch.ENABLED)"], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == str(enabled)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (compiled Triton)")
def test_real_kernels_agree_on_both_paths_and_the_fast_one_engages(monkeypatch):
    from moe_fn import kernels

    monkeypatch.setattr(_launch, "_CACHE", {})
    g = torch.Generator(device="cuda").manual_seed(0)
    flat = torch.randn(4096 * 256 + 1, device="cuda", generator=g).bfloat16()
    index = torch.randint(0, 4096, (64 * 4,), device="cuda", generator=g)
    aligned = flat[:-1].view(4096, 256)
    misaligned = flat[1:].view(4096, 256)  # 2 bytes past a 16-byte boundary
    assert misaligned.data_ptr() % 16 == 2
    results = {}
    for enabled in (False, True):
        monkeypatch.setattr(_launch, "ENABLED", enabled)
        for name, src in (("aligned", aligned), ("misaligned", misaligned)):
            outs = [kernels.gather_sum_fwd(src, index, 4)[0] for _ in range(3)]
            torch.testing.assert_close(outs[0], outs[2], rtol=0, atol=0)
            results[enabled, name] = outs[-1]
    for name in ("aligned", "misaligned"):
        torch.testing.assert_close(results[True, name], results[False, name], rtol=0, atol=0)
    assert not torch.equal(results[True, "aligned"], results[True, "misaligned"])
    live = [e for e in _launch._CACHE.values() if e is not None]
    assert len(live) >= 2, "the fast path never engaged on this Triton"


_EDGE_VALUES = [0, 1, 2, 15, 16, 17, 48, -16, 2**31 - 1, 2**31, 2**31 + 16, -2**31,
                -2**31 - 1, 2**63 - 1, 2**63, True, False, 1.5, None]


def _triton_specialisation(a):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, a, False, True, True)


def test_the_key_separates_everything_triton_s_own_specialisation_separates():
    pytest.importorskip("triton._C.libtriton")
    base = torch.zeros(64)
    values = _EDGE_VALUES + [base, base[1:], base[4:], base.double(), base.bfloat16()[1:]]
    for a in values:
        for b in values:
            if _launch._arg_key(a) == _launch._arg_key(b):
                assert _triton_specialisation(a) == _triton_specialisation(b), (a, b)


def test_hook_detection_on_this_triton():
    knobs = pytest.importorskip("triton.knobs")
    hook = knobs.runtime.launch_enter_hook
    assert not _launch._hooks_set()
    if hasattr(hook, "add"):
        hook.add(print)
        try:
            assert _launch._hooks_set()
        finally:
            hook.remove(print)
    else:
        knobs.runtime.launch_enter_hook = print
        try:
            assert _launch._hooks_set()
        finally:
            knobs.runtime.launch_enter_hook = hook
    assert not _launch._hooks_set()


def test_column_offsets_past_int32_get_a_contiguous_copy():
    """The kernels that take any strides multiply column index by column stride in int32:
    a column-strided view whose last column lies 2**31 elements or more from its first is
    copied contiguous first (meta tensors: the sizes without the memory)."""
    from moe_fn.kernels._launch import int32_columns

    near = torch.empty_strided((4, 17), (1, 2**27 - 1), device="meta")  # 16 * stride < 2**31
    far = torch.empty_strided((4, 17), (1, 2**27), device="meta")  # column 16 at 2**31
    assert int32_columns(near) is near
    copied = int32_columns(far)
    assert copied.shape == far.shape and copied.is_contiguous()
    row_major = torch.empty((2**20, 3000), device="meta")  # large, but unit column stride
    assert int32_columns(row_major) is row_major


@pytest.mark.parametrize("kernel", ["swiglu_bwd", "row_weight_fwd", "row_weight_bwd",
                                    "router_fwd"])
def test_strided_operands_pass_through_the_int32_column_guard(monkeypatch, kernel):
    """Every launcher hands its caller-strided operands to int32_columns (a spy here) and
    computes with what it returns; on the GPU where there is one, else in the interpreter
    (the launchers take the device of their operands)."""
    from moe_fn.kernels import activation, router, row_weight
    from moe_fn.testing import assert_all_close_to_ref, assert_close_to_ref

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not activation.interpreting():
        pytest.skip("needs a GPU, or TRITON_INTERPRET=1 before triton is imported")
    seen = []

    def spy(t):
        seen.append(tuple(t.shape))
        return t.contiguous()
    for mod in (activation, router, row_weight):
        monkeypatch.setattr(mod, "int32_columns", spy)
    g = torch.Generator().manual_seed(0)
    t = torch.randn(6, 5, generator=g).t()  # (5, 6), column stride 5
    other = torch.randn(5, 6, generator=g)
    w = torch.rand(5, generator=g)
    t64, other64, w64 = t.double(), other.double(), w.double()
    t_dev = t.to(dev)  # (.to keeps the strides)
    assert t_dev.stride() == t.stride()
    if kernel == "swiglu_bwd":
        gate, up = other.to(dev), other.clone().to(dev)
        got = activation.launch_swiglu_bwd(gate, up, None, t_dev, 0, 0.0, 0.0,
                                           needs=(True, True, False))[:2]
        assert_all_close_to_ref([v.cpu() for v in got], activation_pure_bwd(other, t),
                                activation_pure_bwd(other64, t64), ("d_gate", "d_up"))
    elif kernel == "row_weight_fwd":
        assert_close_to_ref(row_weight.launch_row_weight_fwd(t_dev, w.to(dev)).cpu(),
                            t * w[:, None], t64 * w64[:, None])
    elif kernel == "row_weight_bwd":
        dx, dw = row_weight.launch_row_weight_bwd(t_dev, w.to(dev), t_dev)
        assert_all_close_to_ref([dx.cpu(), dw.cpu()], [t * w[:, None], (t * t).sum(1)],
                                [t64 * w64[:, None], (t64 * t64).sum(1)], ("d_rows", "d_w"))
    else:
        idx, *_ = router.launch_router_fwd(t_dev, None, top_k=2, score_id=0, norm=False,
                                           scale=1.0)
        assert torch.equal(idx.cpu().sort(1).values,
                           t.softmax(-1).topk(2).indices.sort(1).values)
    assert (5, 6) in seen, seen


def activation_pure_bwd(gate, dh):
    """d(silu(gate) * up)/d(gate, up) at up = gate, written out."""
    s = torch.sigmoid(gate)
    silu = gate * s
    return dh * gate * s * (1 + gate * (1 - s)), dh * silu
