"""Kernel launches with less host time per launch.

``kernel[grid](...)`` re-derives on every call what Triton compiles a kernel for (each
argument's type, 16-byte alignment, divisibility by 16, whether an int is 1) through its
generic binder, then looks the compiled kernel up. On the H200 hosts of bench/RESULTS.md
a kernel call cost 30-115 µs of host time, and an eager layer forward's host time (0.7-1.5 ms) is
of the order of its kernel time (1.4 ms), so launch cost decides whether the GPU waits.
``launch`` keys its own cache on exactly those properties, computed directly, and after
the first (ordinary, compiling) launch of a specialisation calls the compiled kernel's
launcher itself.

Any case it does not cover takes Triton's own path: the interpreter, launch hooks
(profilers such as proton set them), argument kinds it does not key (anything but
tensors, ints, floats, bools and None), and a Triton whose compiled kernels lack the
launcher attributes. ``MOE_FN_FAST_LAUNCH=0`` in the environment, or ``ENABLED = False``,
turns it off (benchmarks compare the two).
"""

from __future__ import annotations

import inspect
import os

import torch

from .._checks import env_flag

try:
    from triton import knobs as _knobs
except ImportError:  # a Triton without ``knobs`` cannot say whether hooks are set
    _knobs = None

ENABLED = env_flag("MOE_FN_FAST_LAUNCH", True)

# (kernel, device, typed constexprs/options, argument keys, tune key, Triton's options) ->
# launcher entry, or None for "use Triton's path for this key".
_CACHE: dict = {}
_I32 = 2**31
_I64 = 2**63


def interpreting() -> bool:
    """Whether Triton runs its interpreter (kernels on CPU tensors) instead of compiling."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code: Triton's goes through its JIT call machinery, which
    costs the host microseconds per call."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _arg_key(a):
    """What Triton specialises a runtime argument on; ``...`` when not keyed here."""
    t = type(a)  # exact-type checks first: this runs for every argument of every launch
    if t is int:
        return (a == 1, a % 16 == 0, 0 if -_I32 <= a < _I32 else 1 if -_I64 <= a < _I64 else 2)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if t is float or t is bool or a is None:
        return t
    return ...


def _active(hook) -> bool:
    # A callable, or (newer Tritons) a chain of them that may be empty.
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    if _knobs is None:
        return True
    rt = _knobs.runtime
    return _active(rt.launch_enter_hook) or _active(rt.launch_exit_hook)


def _launcher(compiled, names, n_args, params):
    """``(run, function, packed_metadata, tail)`` of a compiled kernel, or None when this
    Triton's compiled kernels do not expose them (then Triton's path is used)."""
    try:
        run = compiled.run
        function, packed = compiled.function, compiled.packed_metadata
    except AttributeError:
        return None
    if run is None or function is None:
        return None
    # The launcher takes every parameter in signature order, constexprs included.
    try:
        tail = tuple(params[n] for n in names[n_args:])
    except KeyError:  # a parameter neither passed nor declared with a default
        return None
    return run, function, packed, tail


def _knob_state():
    """Global Triton options that change what ``kernel[grid]`` compiles."""
    if _knobs is None:
        return None
    return (getattr(_knobs.runtime, "debug", None),
            getattr(_knobs.compilation, "instrumentation_mode", None))


def launch(kernel, grid, *args, tune_key=(), **params):
    """``kernel[grid](*args, **params)``, faster on repeat calls.

    ``args`` are the kernel's leading runtime arguments, positionally; ``params`` the
    rest by name (constexprs, then launch options such as ``num_warps``). ``grid`` is a
    tuple, or a callable of the arguments by name (for an autotuned ``kernel``), whose
    runtime key values the caller passes as ``tune_key`` so that each keeps its own
    config. Mutable globals a kernel reads are not re-checked on the fast path (Triton
    checks them per launch); moe_fn's kernels read none."""
    # is_initialized, not is_available: a launch on CUDA tensors has initialised CUDA, and
    # is_available asks the driver (and reads the environment) on every call, ~5 us here.
    if not ENABLED or not torch.cuda.is_initialized():
        return _slow(kernel, grid, args, params)
    keys = tuple([_arg_key(a) for a in args])
    if ... in keys or _hooks_set():
        return _slow(kernel, grid, args, params)
    device = torch.cuda.current_device()
    # Typed: Triton compiles True and 1, or 32 and 32.0, separately.
    key = (kernel, device, tuple([(k, type(v), v) for k, v in params.items()]), keys,
           tune_key, _knob_state())
    entry = _CACHE.get(key, ...)
    if entry is ...:  # first launch of this specialisation: Triton compiles and launches
        compiled = _slow(kernel, grid, args, params)
        _CACHE[key] = _entry(kernel, compiled, len(args), params)
        return compiled
    if entry is None:
        return _slow(kernel, grid, args, params)
    run, function, packed, tail, jit, chosen = entry
    if getattr(jit, "pre_run_hooks", None):  # added since: Triton must run them
        return _slow(kernel, grid, args, params)
    g = grid({**dict(zip(jit.arg_names, args)), **chosen}) if callable(grid) else grid
    stream = torch._C._cuda_getCurrentRawStream(device)
    run(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, stream, function, packed,
        None, None, None, *args, *tail)
    return None


def _slow(kernel, grid, args, params):
    return kernel[grid](*args, **params)


def _jit_types():
    from triton.runtime.jit import JITFunction

    return (JITFunction,)


def _entry(kernel, compiled, n_args, params):
    """The cache entry after an ordinary launch returned ``compiled``: the launcher, the
    JIT function and the parameters the grid is computed from (an autotuner's chosen
    config included); None for what only Triton's path handles."""
    if compiled is None:  # the interpreter, or a Triton whose launch returns nothing
        return None
    jit, chosen = kernel, dict(params)
    configs = getattr(kernel, "configs", None)
    if configs is not None:  # an autotuner: the config it picked for these arguments
        config = getattr(kernel, "best_config", None)
        if config is None or getattr(config, "pre_hook", None) is not None:
            return None
        chosen.update(config.all_kwargs())
        jit = kernel.fn
    # Anything but a plain JIT function (heuristics, say, which compute constexprs from
    # runtime values) keeps Triton's path.
    if not isinstance(jit, _jit_types()) or getattr(jit, "pre_run_hooks", None):
        return None
    # Parameters left to their declared defaults are bound to them, as Triton binds them.
    bound = {**_defaults(jit), **chosen}
    launcher = _launcher(compiled, jit.arg_names, n_args, bound)
    return None if launcher is None else (*launcher, jit, chosen)


def _defaults(jit) -> dict:
    """A JIT function's declared parameter defaults by name (none known: empty)."""
    out = {}
    for p in getattr(jit, "params", ()):
        default = getattr(p, "default", inspect.Parameter.empty)
        if default is not inspect.Parameter.empty:
            out[p.name] = default
    return out


def int32_columns(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where its last dimension's offsets (column index times
    column stride, int32 in the kernels that take any strides) would pass 2**31 - 1: a
    column-strided view (a transpose) of over ~2**31 / width rows."""
    if t.dim() and (t.shape[-1] - 1) * abs(t.stride(-1)) >= 2**31:
        return t.contiguous()
    return t
