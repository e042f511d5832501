"""Where a MoELayer's GPU time goes: a torch.profiler table of its kernels, and the
event-timed call (the suite's clock) against the sum of its kernel times (a gap is time the
GPU waited for the host: launch overhead or a host sync). The layer is the suite's
(``bench/shapes.py``: model, arm).

    python bench/profile_layer.py [--model qwen3-30b-a3b] [--tokens 8192] \
        [--arm moe_fn|moe_fn-reference] [--phase fwd|fwd+bwd] [--trace trace.json] [--out p.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import harness, shapes
from moe_fn import MoELayer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=shapes.QWEN3.name,
                    choices=[m.name for m in (shapes.QWEN3, shapes.MIXTRAL,
                                              shapes.DEEPSEEK_V3_RANK, shapes.SMALL)])
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--arm", choices=list(shapes.MOE_FN_ARMS), default="moe_fn")
    ap.add_argument("--phase", choices=("fwd", "fwd+bwd"), default="fwd+bwd")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--rows", type=int, default=30, help="kernel table rows")
    ap.add_argument("--trace", default=None, help="write a chrome trace here")
    ap.add_argument("--out", default=None, help="JSON (the suite's format)")
    a = ap.parse_args(argv)
    if not harness.HAS_CUDA:
        print("needs a CUDA device", file=sys.stderr)
        return 2
    model = next(m for m in (shapes.QWEN3, shapes.MIXTRAL, shapes.DEEPSEEK_V3_RANK,
                             shapes.SMALL) if m.name == a.model)
    if a.tokens:
        model = model.with_tokens(a.tokens)
    layer = MoELayer(model.config(**shapes.MOE_FN_ARMS[a.arm]), device="cuda",
                     dtype=torch.bfloat16)
    x = torch.randn(model.tokens, model.hidden, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        layer.zero_grad(set_to_none=True)  # no gradient accumulation pass
        x.grad = None
        out = layer(x)
        if a.phase == "fwd+bwd":
            out.backward(dy)

    times = harness.time_rounds(step, rounds=a.rounds, warmup=5)
    reps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_ms = sum(getattr(e, "self_device_time_total", 0) for e in kernels) / reps / 1e3
    wall = harness.median_ms(times)
    print(f"{model.name} {a.arm} {a.phase}: event-timed {wall:.3f} ms, sum of kernel "
          f"times {kernel_ms:.3f} ms per call")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows,
                                    max_name_column_width=70))
    if a.trace:
        prof.export_chrome_trace(a.trace)
    breakdown = {e.key: getattr(e, "self_device_time_total", 0) / reps / 1e3
                 for e in kernels}
    entry = harness.benchmark_entry(
        f"layer profile · {model.name} {a.phase}", a.arm, times,
        params={"model": model.name, "arm": a.arm, "phase": a.phase},
        extra_info={"kernel_ms_sum": kernel_ms, "kernel_ms": breakdown,
                    "options": shapes.MOE_FN_ARMS[a.arm]})
    harness.write_benchmark_json(a.out, [entry])
    return 0


if __name__ == "__main__":
    sys.exit(main())
