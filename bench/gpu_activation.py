"""GPU throughput of the packed activation kernels against the device copy bandwidth.

Run on a CUDA machine:  python bench/gpu_activation.py --out $OUT/act.json

1. Device-to-device copy of a 2 GiB tensor: (bytes read + bytes written) / time.
2. The ``moe_fn::swiglu_packed_fwd`` / ``_bwd`` ops (Triton) at N=131072, I=768 bf16 for
   both layouts, swiglu and swiglu_oai, with and without a folded routing weight; the
   bytes counted are those the op must move (inputs read once, outputs written once).
3. Plain PyTorch eager ``silu(g) * u`` on the chunked halves (and its autograd backward)
   with the same byte count, for comparison.
Every kernel result is checked against the pure path (error vs float64 on a row sample
at most 2x the pure path's own error plus one bf16 step). Timings are medians over CUDA
event pairs around 10 back-to-back calls, after a warm-up (which also runs the autotuner).
Prints a table and writes JSON. ``MOE_FN_AUTOTUNE=0`` times the fixed heuristic blocks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

import moe_fn.kernels as ops
from moe_fn.pure import activations as pa


def time_ms(fn, *, warmup: int = 5, iters: int = 20, inner: int = 10) -> float:
    """Median over ``iters`` CUDA-event pairs of the mean ms of ``inner`` back-to-back calls
    (back to back, so host-side launch overhead hides behind the previous kernel)."""
    if not torch.cuda.is_available():  # --smoke on a CPU: wall clock, one call
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes read + written per second by a device-to-device copy of ``gib`` GiB."""
    n = int(gib * (1 << 30))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda s=src, d=dst: d.copy_(s), iters=10, inner=5)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)


def _err_ok(kern, pure, ref64):
    err_k = (kern.double() - ref64).abs().max().item()
    err_p = (pure.double() - ref64).abs().max().item()
    step = torch.finfo(kern.dtype).eps * ref64.abs().max().item()
    return err_k <= 2 * err_p + step, err_k, err_p


def check_case(gate_up, w, dh, act_id, alpha, limit, layout_id, rows: int = 2048):
    """Kernel (through the op) vs pure vs float64 on the first ``rows`` rows."""
    gu, ww, d = gate_up[:rows], (None if w is None else w[:rows]), dh[:rows]
    kw = dict(act_id=act_id, alpha=alpha, limit=limit, layout_id=layout_id)
    hk, rk = ops.swiglu_packed_fwd(gu, ww, **kw)
    hp, rp = pa.swiglu_packed_fwd(gu, ww, **kw)
    h64, r64 = pa.swiglu_packed_fwd(gu.double(), None if ww is None else ww.double(), **kw)
    results = [_err_ok(hk, hp, h64)]
    for a, b, c in zip(ops.swiglu_packed_bwd(rk, d), pa.swiglu_packed_bwd(rp, d),
                       pa.swiglu_packed_bwd(r64, d.double())):
        if a is not None:
            results.append(_err_ok(a, b, c))
    return all(ok for ok, _, _ in results), max(e for _, e, _ in results)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--i", type=int, default=768)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--copy-gib", type=float, default=2.0)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU dry run of the script (tiny shapes; kernels under TRITON_INTERPRET)")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from moe_fn.kernels import _registry

        _registry.use_triton = lambda t: t.dtype != torch.float64
        args.n, args.i, args.iters, args.copy_gib = 100, 24, 1, 1 / 1024
    elif not torch.cuda.is_available():
        print("needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)"
    dtype = torch.bfloat16
    n, i = args.n, args.i
    es = torch.finfo(dtype).bits // 8

    copy_bps = copy_bandwidth(args.copy_gib)
    print(f"device: {name}  torch {torch.__version__}  "
          f"triton {triton.__version__}")
    print(f"copy bandwidth ({args.copy_gib:g} GiB, read + write): {copy_bps / 1e9:.0f} GB/s")

    gate_up = (torch.randn(n, 2 * i, device=dev) * 3).to(dtype)
    w_full = (torch.rand(n, device=dev) + 0.1).to(dtype)
    dh = torch.randn(n, i, device=dev).to(dtype)
    ws = w_full.element_size()

    rows = []

    def record(name, ms, nbytes, ok=None, err=None):
        bps = nbytes / (ms * 1e-3)
        rows.append({"case": name, "ms": ms, "bytes": nbytes, "GB/s": bps / 1e9,
                     "pct_copy": 100 * bps / copy_bps, "check_ok": ok, "max_err": err})

    for layout in pa.LAYOUTS:
        layout_id = pa.resolve_layout(layout)
        for act in ("swiglu", "swiglu_oai"):
            act_id, alpha, limit = pa.resolve_activation(act)
            for with_w in (False, True):
                w = w_full if with_w else None
                ok, err = check_case(gate_up, w, dh, act_id, alpha, limit, layout_id)
                kw = dict(act_id=act_id, alpha=alpha, limit=limit, layout_id=layout_id)
                tag = f"{layout:11s} {act:10s} {'w' if with_w else '-'}"
                _, res = ops.swiglu_packed_fwd(gate_up, w, **kw)
                fwd_bytes = n * 2 * i * es + n * i * es + (n * ws if with_w else 0)
                ms = time_ms(lambda w=w, kw=kw: ops.swiglu_packed_fwd(gate_up, w, **kw),
                             iters=args.iters)
                record(f"fwd {tag}", ms, fwd_bytes, ok, err)
                bwd_bytes = n * 2 * i * es * 2 + n * i * es + (2 * n * ws if with_w else 0)
                ms = time_ms(lambda res=res: ops.swiglu_packed_bwd(res, dh), iters=args.iters)
                record(f"bwd {tag}", ms, bwd_bytes, ok, err)

    # Plain PyTorch eager for comparison (swiglu, no weights), same byte count.
    for layout in pa.LAYOUTS:
        g, u = (gate_up.chunk(2, dim=-1) if layout == "halves"
                else (gate_up[:, 0::2], gate_up[:, 1::2]))
        ms = time_ms(lambda g=g, u=u: F.silu(g) * u, iters=args.iters)
        record(f"fwd {layout:11s} eager silu(g)*u -", ms, n * 2 * i * es + n * i * es)
        gl = gate_up.detach().requires_grad_(True)

        def eager_bwd(gl=gl, layout=layout):
            gg, uu = (gl.chunk(2, dim=-1) if layout == "halves"
                      else (gl[:, 0::2], gl[:, 1::2]))
            (F.silu(gg) * uu).backward(dh)
            gl.grad = None

        ms = time_ms(eager_bwd, iters=max(10, args.iters // 2))
        record(f"f+b {layout:11s} eager autograd   -", ms, n * 2 * i * es * 2 + n * i * es)

    hdr = f"{'case':44s} {'ms':>8s} {'GB/s':>8s} {'%copy':>7s}  check"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        chk = "" if r["check_ok"] is None else ("ok" if r["check_ok"] else "FAIL")
        print(f"{r['case']:44s} {r['ms']:8.4f} {r['GB/s']:8.0f} {r['pct_copy']:6.1f}%  {chk}")

    from moe_fn.kernels import activation as kact

    tuned = {}
    for name, fn in (("act_fwd", kact._act_fwd_tuned), ("act_bwd", kact._act_bwd_tuned)):
        tuned[name] = {str(k): str(v) for k, v in getattr(fn, "cache", {}).items()}
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "autotune": os.environ.get("MOE_FN_AUTOTUNE", "1"),
        "shape": {"N": n, "I": i, "dtype": str(dtype)},
        "copy_GBps": copy_bps / 1e9,
        "rows": rows,
        "autotuned_configs": tuned,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")
    failed = [r["case"] for r in rows if r["check_ok"] is False]
    if failed:
        print(f"CHECK FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
