"""The benchmark suite's fixtures: ``measure`` (pytest-benchmark's fixture driven in
pedantic mode by the suite's clock, with ``extra_info``) and the ceilings measured once per
run; hooks that put the environment into the JSON's machine_info, each benchmark's speedups
over the reference arms of its group into its extra_info, and a ratio table at the end."""

from __future__ import annotations

import functools
import os

import torch

# Without a GPU, Triton kernels run in its interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from bench import harness  # noqa: E402

if os.environ.get("MOE_FN_TEST_MUTATION"):  # a deliberate wrong change (tests/mutations.py)
    import tests  # noqa: E402, F401

# (rounds, warm-up rounds) per benchmark: GPU rounds are cheap, CPU ones are not.
DEFAULT_ROUNDS = (20, 5) if harness.HAS_CUDA else (5, 1)
# The arms others are compared with, in this order of preference.
REFERENCE_ARMS = ("torch", "transformers", "moe_fn-reference", "unchecked", "triton")


def pytest_addoption(parser):
    group = parser.getgroup("moe_fn benchmarks")
    group.addoption("--bench-rounds", type=int, default=None,
                    help=f"timed rounds per benchmark (default {DEFAULT_ROUNDS[0]})")
    group.addoption("--bench-warmup", type=int, default=None,
                    help=f"untimed warm-up rounds per benchmark (default {DEFAULT_ROUNDS[1]})")


class Ceilings:
    """A bf16 (GPU) / float32 (CPU) matmul and a device copy, measured once per run."""

    def __init__(self):
        self._flops = self._bytes = None

    @property
    def flops(self) -> float:
        if self._flops is None:
            self._flops = harness.matmul_ceiling_flops()
        return self._flops

    @property
    def bytes(self) -> float:
        if self._bytes is None:
            self._bytes = harness.copy_ceiling_bytes()
        return self._bytes


# One of each per process, made when a benchmark first asks (the flush holds 256 MiB).
@functools.cache
def _ceilings() -> Ceilings:
    return Ceilings()


@functools.cache
def _l2_flush() -> harness.L2Flush:
    return harness.L2Flush()


@pytest.fixture
def ceilings():
    return _ceilings()


@pytest.fixture
def l2_flush():
    return _l2_flush()


@pytest.fixture(scope="module", autouse=True)
def _release_inputs():
    yield
    harness.release_inputs()


@pytest.fixture
def measure(benchmark, request, ceilings, l2_flush):
    """``measure(fn, shape=..., flops=..., nbytes=..., flush_l2=..., setup=...)``: time
    ``fn()`` over the suite's rounds with the clock the test's benchmark marker names and
    fill ``extra_info``: FLOPs and TFLOP/s or bytes and GB/s, and the fraction of the
    matmul / copy ceiling measured in this run. ``flush_l2``: overwrite the L2 cache
    before each round (the GPU then starts on the flush, the host's launches queued behind
    it). Returns ``fn()``'s last result."""
    marker = request.node.get_closest_marker("benchmark")
    if marker is None or "group" not in marker.kwargs:
        raise pytest.UsageError(f"{request.node.nodeid}: mark it "
                                "@pytest.mark.benchmark(group=..., timer=harness.CLOCK)")
    clock = marker.kwargs.get("timer")
    if clock not in (harness.CLOCK, harness.HOST_CLOCK):
        raise pytest.UsageError(f"{request.node.nodeid}: its benchmark marker must set "
                                "timer=harness.CLOCK (or harness.HOST_CLOCK)")
    opt = request.config.getoption
    rounds = opt("bench_rounds") or DEFAULT_ROUNDS[0]
    warmup = DEFAULT_ROUNDS[1] if opt("bench_warmup") is None else opt("bench_warmup")
    params = getattr(request.node, "callspec", None)
    arm = params.params.get("arm") if params else None

    def run(fn, *, shape: str, flops: float | None = None, nbytes: float | None = None,
            flush_l2: bool = False, setup=None, info: dict | None = None):
        benchmark.group = f"{marker.kwargs['group']} · {shape}"
        extra = benchmark.extra_info
        extra.update(device=harness.environment()["device"], dtype=str(harness.dtype()),
                     shape=shape, clock=clock.__name__, l2_flush=bool(flush_l2),
                     **(info or {}))
        if flops is not None:
            extra["flops"] = flops
        if nbytes is not None:
            extra["bytes"] = nbytes
        before = setup
        if flush_l2:
            def before():
                l2_flush()
                if setup is not None:
                    setup()
        if isinstance(clock, harness.CudaEventClock):
            clock.reset()
        result = benchmark.pedantic(fn, setup=before, rounds=rounds, warmup_rounds=warmup)
        if benchmark.stats is not None and benchmark.stats.stats.data:
            med = benchmark.stats.stats.median
            extra["median_ms"] = med * 1e3
            if flops is not None:
                extra["tflops"] = flops / med / 1e12
                extra["ceiling_tflops"] = ceilings.flops / 1e12
                extra["of_ceiling"] = flops / med / ceilings.flops
            if nbytes is not None:
                extra["gbs"] = nbytes / med / 1e9
                extra["ceiling_gbs"] = ceilings.bytes / 1e9
                extra["of_ceiling"] = nbytes / med / ceilings.bytes
            harness.RECORDS.append((benchmark.group, arm, med))
        return result

    run.rounds, run.warmup = rounds, warmup
    return run


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info.update(harness.environment())


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """Each benchmark's speedup over the reference arms of its group (their median over
    its median), measured side by side in this run."""
    medians = {}
    for b in output_json["benchmarks"]:
        arm = (b.get("params") or {}).get("arm")
        if arm is not None and b.get("stats"):
            medians[(b["group"], arm)] = b["stats"]["median"]
    for b in output_json["benchmarks"]:
        if not b.get("stats"):
            continue
        arm = (b.get("params") or {}).get("arm")
        for ref in REFERENCE_ARMS:
            if ref != arm and (b["group"], ref) in medians:
                b["extra_info"][f"speedup_vs_{ref}"] = (medians[(b["group"], ref)]
                                                        / b["stats"]["median"])


def pytest_terminal_summary(terminalreporter):
    if not harness.RECORDS:
        return
    groups = {}
    for group, arm, med in harness.RECORDS:
        groups.setdefault(group, {})[arm] = med
    tr = terminalreporter
    tr.section("moe_fn: median ms per arm, and speedups measured side by side in this run")
    for group, arms in groups.items():
        refs = [r for r in REFERENCE_ARMS if r in arms]
        cells = []
        for arm, med in arms.items():
            ratio = "".join(f", {arms[r] / med:.2f}x vs {r}" for r in refs if r != arm)
            cells.append(f"{arm} {med * 1e3:.3f}{ratio}")
        tr.write_line(f"{group}: " + "; ".join(cells))
