"""Timing and ceilings shared by the GPU benchmark scripts (CUDA events, medians)."""

from __future__ import annotations

import json
import platform
import statistics
import time

import torch


def cuda_time(fn, *, warmup: int = 5, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` CUDA-event-timed runs after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_ceiling_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time(lambda: a @ b, reps=10)
    return 2 * n ** 3 / ms / 1e9


def copy_ceiling_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time(lambda: dst.copy_(src), reps=10)
    return 2 * nbytes / ms / 1e6


def environment() -> dict:
    import triton
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "" if v is None else str(v)
