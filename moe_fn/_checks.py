"""Argument checks shared by every room: fail at the call, naming the argument.

Value checks that would need a device-to-host sync (``offs`` on CUDA) only run when
debug checks are on: ``moe_fn.set_debug_checks(True)`` or ``MOE_FN_DEBUG=1``.
"""

from __future__ import annotations

import os

import torch


def env_flag(name: str, default: bool) -> bool:
    """A switch in the environment: unset gives ``default``; "", 0, false, no and off (any
    case) are off, anything else on."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in ("", "0", "false", "no", "off")


_debug = env_flag("MOE_FN_DEBUG", False)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def set_debug_checks(enabled: bool) -> None:
    """Switch on (or off) the checks that cost a device-to-host sync; process-wide.

    With debug checks on, the values of CUDA tensors are checked as CPU ones always are:
    ``moe_fn.functional``'s ``offs`` (non-decreasing, non-negative, ending at the row
    count) and the expert indices a dispatch layout is built from (in
    ``[0, num_experts)``); and a MoELayer checks its router's score-correction bias for
    non-finite values at every call (a state dict that loads one is checked either way).
    Off by default; ``MOE_FN_DEBUG=1`` in the environment turns them on at import. They
    are skipped while ``torch.compile`` traces.

    Args:
        enabled: True to turn the checks on, False to turn them off.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    global _debug
    if not isinstance(enabled, bool):
        raise TypeError(f"set_debug_checks takes a bool, got {enabled!r}")
    _debug = enabled


def debug_checks() -> bool:
    """Whether the checks that cost a device-to-host sync are on (``set_debug_checks``)."""
    return _debug


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")


def check_same(names: str, *tensors: torch.Tensor, dtype: bool = True) -> None:
    first = tensors[0]
    for t in tensors[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{names} must be on one device, got {[str(x.device) for x in tensors]}"
            )
        if dtype and t.dtype != first.dtype:
            raise TypeError(f"{names} must share one dtype, got {[x.dtype for x in tensors]}")


def check_offs(offs, num_rows: int, num_groups: int, device: torch.device) -> None:
    """``offs``: int32 cumulative row ends, one per expert, ending at ``num_rows``."""
    check_tensor("offs", offs, ndim=1)
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must be int32 (torch._grouped_mm's convention), got {offs.dtype}")
    if offs.numel() != num_groups:
        raise ValueError(f"offs must have one entry per expert ({num_groups}), got {offs.numel()}")
    if offs.device != device:
        raise ValueError(f"offs must be on {device}, got {offs.device}")
    # Reading values needs the host: skipped while torch.compile traces (a full graph
    # cannot sync), done on CPU tensors, and on CUDA only with debug checks on.
    if (offs.device.type == "cpu" or _debug) and not torch.compiler.is_compiling():
        if num_groups == 0:
            if num_rows != 0:
                raise ValueError(f"no experts but {num_rows} rows")
            return
        diffs = offs[1:] - offs[:-1]
        if bool((diffs < 0).any()) or int(offs[0]) < 0:
            raise ValueError(f"offs must be non-decreasing and non-negative, got {offs.tolist()}")
        if int(offs[-1]) != num_rows:
            raise ValueError(
                f"offs must end exactly at the row count {num_rows}, got {int(offs[-1])}: "
                "rows past the last offset would be left unwritten"
            )


def check_fp8_call(x: torch.Tensor) -> None:
    """Where ``expert_precision='fp8_rowwise'`` can run, said at the first call per dtype and
    device: on CUDA a bfloat16 layer (the FP8 GEMMs write only bfloat16) on a GPU with
    ``torch._scaled_grouped_mm``'s FP8 tensor cores; on the CPU an emulation for tests."""
    fix = "or set expert_precision='native'"
    if x.is_cuda:
        cap = torch.cuda.get_device_capability(x.device)
        if cap < (9, 0):
            name = torch.cuda.get_device_name(x.device)
            raise ValueError(f"expert_precision='fp8_rowwise' needs FP8 tensor cores that "
                             f"torch._scaled_grouped_mm runs on (compute capability 9.0 or "
                             f"later: H100, H200, B200); {name} has {cap[0]}.{cap[1]}: " + fix)
        if x.dtype != torch.bfloat16:
            raise TypeError(f"expert_precision='fp8_rowwise' on CUDA needs a bfloat16 layer "
                            f"(torch._scaled_grouped_mm writes bfloat16 only), got {x.dtype}: "
                            "layer.to(torch.bfloat16), or run under torch.autocast(dtype="
                            "torch.bfloat16), " + fix)
    elif x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"expert_precision='fp8_rowwise' computes in bfloat16 (or float32 on "
                        f"the CPU, an emulation), got {x.dtype}: cast the layer, " + fix)
