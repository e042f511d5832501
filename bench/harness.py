"""What the benchmarks share: clocks, the measuring loop, ceilings, the environment, and the
JSON format (pytest-benchmark's, so the torchrun scripts' files compare like the suite's).

Clocks (pytest-benchmark timers: two consecutive calls bracket one round):

- ``CLOCK``: on a CUDA machine :class:`CudaEventClock` (GPU time between two CUDA events,
  read after the second has completed; never the wall time of unsynchronised launches),
  on a CPU ``time.perf_counter`` (CPU ops are synchronous).
- ``HOST_CLOCK``: ``time.perf_counter`` without synchronising: host time per call, for
  launch-overhead benchmarks that keep the GPU busy so that the host never waits.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import platform
import statistics
import time
import weakref

import torch

# Bytes written to flush the L2 cache between rounds (H200: 50 MiB of L2).
L2_FLUSH_BYTES = 256 << 20


class CudaEventClock:
    """A pytest-benchmark timer reading GPU time from CUDA events.

    The first call of a pair records a start event; the second records an end event, waits
    for it and adds the time between the two to a running total, which every call returns.
    So ``end - start`` of a round is the GPU time from the start event to the end event:
    from an idle GPU it includes the host's launch time before the first kernel; behind
    queued work (an L2 flush) the host's launches overlap that work.
    """

    __name__ = "cuda_event_clock"

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.total = 0.0
        self._start = None

    def __call__(self) -> float:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._start is None:
            self._start = event
            return self.total
        event.synchronize()
        self.total += self._start.elapsed_time(event) / 1e3
        self._start = None
        return self.total


def _host_clock() -> float:
    return time.perf_counter()


_host_clock.__name__ = "host_clock"
HAS_CUDA = torch.cuda.is_available()
# (group, arm, median seconds) of every benchmark timed in this process, for the summary.
RECORDS: list = []
CLOCK = CudaEventClock() if HAS_CUDA else time.perf_counter
HOST_CLOCK = _host_clock


def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


def dtype() -> torch.dtype:
    """The benchmarks' dtype: bfloat16 on a GPU, float32 on a CPU (bfloat16 there measures
    emulation)."""
    return torch.bfloat16 if HAS_CUDA else torch.float32


def sync() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


class L2Flush:
    """Overwrites a buffer larger than the L2 cache (a no-op on a CPU)."""

    def __init__(self):
        self.buf = (torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
                    if HAS_CUDA else None)

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.zero_()


def time_rounds(fn, *, rounds: int, warmup: int, setup=None, clock=None) -> list[float]:
    """Seconds per round of ``fn()`` by ``clock`` (default ``CLOCK``), after ``warmup``
    untimed rounds; ``setup()`` runs before each round, untimed. The suite times through
    pytest-benchmark with the same clock; scripts call this."""
    clock = CLOCK if clock is None else clock
    if isinstance(clock, CudaEventClock):
        clock.reset()
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    sync()
    times = []
    for _ in range(rounds):
        if setup is not None:
            setup()
        start = clock()
        fn()
        times.append(clock() - start)
    return times


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def matmul_ceiling_flops(*, rounds: int = 10) -> float:
    """FLOP/s of a large matmul in the benchmarks' dtype (bf16 8192^3 on a GPU, float32
    1024^3 on a CPU)."""
    n = 8192 if HAS_CUDA else 1024
    g = torch.Generator(device=device()).manual_seed(0)
    a = torch.randn(n, n, device=device(), dtype=dtype(), generator=g)
    b = torch.randn(n, n, device=device(), dtype=dtype(), generator=g)
    t = statistics.median(time_rounds(lambda: a @ b, rounds=rounds, warmup=3))
    return 2 * n ** 3 / t


def copy_ceiling_bytes(*, rounds: int = 10) -> float:
    """Bytes read + written per second by a device copy (2 GiB on a GPU, 64 MiB on a CPU)."""
    n = (2 << 30) if HAS_CUDA else (64 << 20)
    bufs = [torch.empty(n, dtype=torch.uint8, device=device()).fill_(1)]
    bufs.append(torch.empty_like(bufs[0]))
    t = statistics.median(time_rounds(lambda: bufs[1].copy_(bufs[0]), rounds=rounds,
                                      warmup=3))
    bufs.clear()
    if HAS_CUDA:
        torch.cuda.empty_cache()
    return 2 * n / t


@functools.lru_cache(maxsize=1)
def environment() -> dict:
    """Device and versions, as the JSON files record them."""
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if HAS_CUDA else platform.processor()
           or platform.machine(), "cpu_threads": torch.get_num_threads()}
    if HAS_CUDA:
        env["cuda"] = torch.version.cuda
    for name in ("triton", "transformers"):
        with contextlib.suppress(ImportError):
            env[name] = __import__(name).__version__
    return env


def benchmark_entry(group: str, name: str, times: list[float], *, params=None,
                    extra_info=None) -> dict:
    """One benchmark as pytest-benchmark's JSON writes it (times in seconds)."""
    data = sorted(times)
    n = len(data)
    q1, _, q3 = statistics.quantiles(data, n=4) if n > 1 else (data[0],) * 3
    mean = statistics.fmean(data)
    stats = {"min": data[0], "max": data[-1], "mean": mean,
             "stddev": statistics.stdev(data) if n > 1 else 0.0, "rounds": n,
             "median": statistics.median(data), "iqr": q3 - q1, "q1": q1, "q3": q3,
             "iqr_outliers": 0, "stddev_outliers": 0, "outliers": "0;0", "ld15iqr": data[0],
             "hd15iqr": data[-1], "ops": 1 / mean if mean else 0.0, "total": sum(data),
             "iterations": 1, "data": times}
    return {"group": group, "name": name, "fullname": f"{group}::{name}",
            "params": params, "param": name, "extra_info": extra_info or {},
            "options": {"timer": getattr(CLOCK, "__name__", str(CLOCK))}, "stats": stats}


def write_benchmark_json(path: str | None, benchmarks: list[dict], **extra) -> None:
    """A pytest-benchmark style file (``machine_info``, ``commit_info``, ``benchmarks``,
    ``datetime``, ``version``) with ``extra`` beside them (e.g. a script's own tables)."""
    if not path:
        return
    try:
        from pytest_benchmark import __version__
        from pytest_benchmark.utils import get_commit_info
        commit = get_commit_info()
    except ImportError:  # the format without the plugin's own fields
        __version__, commit = None, {}
    doc = {"machine_info": {"node": platform.node(), "machine": platform.machine(),
                            "python_version": platform.python_version(), **environment()},
           "commit_info": commit, "benchmarks": benchmarks,
           "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "version": __version__, **extra}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)


class Latest:
    """Inputs of the latest key only: benchmarks of one shape run together, and dropping
    the previous shape's tensors keeps the GPU's memory for the next. ``release_inputs()``
    drops every instance's (the suite calls it after each file)."""

    def __init__(self):
        self.key = self.value = None
        _LATEST.add(self)

    def clear(self) -> None:
        self.key = self.value = None

    def get(self, key, make):
        if key != self.key:
            self.key = self.value = None
            if HAS_CUDA:
                torch.cuda.empty_cache()
            self.value, self.key = make(), key
        return self.value


_LATEST: weakref.WeakSet = weakref.WeakSet()


def release_inputs() -> None:
    for cache in list(_LATEST):
        cache.clear()
    if HAS_CUDA:
        torch.cuda.empty_cache()


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator(device=device()).manual_seed(seed)


def randn(*shape, scale: float = 1.0, seed: int = 0, dtype_=None) -> torch.Tensor:
    """Normal values in the benchmarks' dtype (or ``dtype_``) on the benchmarks' device."""
    t = torch.randn(*shape, device=device(), generator=generator(seed))
    return (t * scale).to(dtype_ or dtype())


def entries_from_tables(tables: dict, *, prefix: str, note: str) -> list[dict]:
    """Benchmark entries for a script's nested result tables: every ``*_ms`` field, a list
    of per-round times or one summary time (``note`` says what it summarises), named by
    its path."""
    entries = []

    def walk(node, path):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, (*path, str(key)))
                continue
            if not str(key).endswith("_ms"):
                continue
            values = value if isinstance(value, list) else [value]
            if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                     for v in values):
                continue
            group = " · ".join((prefix, *path[:1]))
            name = " ".join((*path[1:], str(key)))
            entries.append(benchmark_entry(group, name, [v / 1e3 for v in values],
                                           extra_info={"summary": note}))
    walk(tables, ())
    return entries
