"""The FP8 row kernels on a GPU: speed against a device copy and their bits against the
pure twins, on the experts' shapes of a Qwen3-30B-A3B layer at 8192 tokens (65,536 routed
rows, H = 2048, I = 768).

    python bench/fp8_kernels_check.py [--rows 65536] [--hidden 2048] [--inter 768] \
        [--top-k 8] [--rounds 50] [--sweep] [--out fp8_kernels.json]

Per kernel: bytes read + written once (the row gathers counted as read per routed row),
median ms of CUDA-event-timed calls with the L2 flushed before each, GB/s and its share of
a 2 GiB device copy's, and whether its bits equal its twin's:

- ``quantize_rows`` / ``quantize_rows_packed`` (with and without a gather index) and
  ``dequantize_rows``: ``moe_fn.pure.fp8``'s functions run on the same GPU tensors;
- ``swiglu_packed_fwd_fp8``: ``quantize_rows`` of what the bf16 activation kernel writes
  (the contract; the pure activation's own bf16 output differs from the kernel's in last
  bits, so the twin composed of pure parts is compared by value, not bits);
- ``swiglu_packed_bwd_fp8``: ``d_gate_up`` the bf16 backward kernel's bits, its FP8 rows
  ``quantize_rows(d_gate_up)``'s; ``d_weights`` (a row sum, its order set by the tuned
  block size, which may differ from the bf16 kernel's) is printed beside.

NaN bytes are compared as one value (rows holding inf or NaN have NaN scales and NaN
bytes; their sign is not part of the contract). ``--sweep`` also times the quantise
kernel's block configurations. The activation kernels autotune in their warm-up rounds
(``MOE_FN_AUTOTUNE=0`` times the fixed heuristic instead).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import harness
from moe_fn import kernels as ops
from moe_fn.kernels import activation as KA
from moe_fn.kernels import fp8 as KF
from moe_fn.pure import activations as PA
from moe_fn.pure import fp8 as PF

FP8 = torch.float8_e4m3fn


def _bytes(q):
    b = q.contiguous().view(torch.uint8).to(torch.int16)
    return torch.where((b & 0x7F) == 0x7F, 0x7F, b)


def same_rows(a, b) -> bool:
    return (a.q.shape == b.q.shape and a.q.dtype == b.q.dtype == FP8
            and torch.equal(a.scale.view(torch.int32), b.scale.view(torch.int32))
            and torch.equal(_bytes(a.q), _bytes(b.q)))


def same_packed(a, b, d) -> bool:
    return (a.shape == b.shape and torch.equal(a[:, d:], b[:, d:])
            and torch.equal(_bytes(a[:, :d].view(FP8)), _bytes(b[:, :d].view(FP8))))


def same_bits(a, b) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan())
            and torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)))


def rows_input(n, d, seed):
    """Normal rows, each scaled by its own power of two, with a row of zeros, one holding
    NaN and one holding -inf."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, d, device="cuda", generator=g)
    x *= torch.exp2(torch.randint(-12, 12, (n, 1), device="cuda", generator=g).float())
    x[0] = 0.0
    x[1, 7] = float("nan")
    x[2, 3] = -float("inf")
    return x.bfloat16()


class Report:
    def __init__(self, rounds, copy_bps):
        self.rounds, self.copy_bps = rounds, copy_bps
        self.flush = harness.L2Flush()
        self.entries, self.rows = [], []

    def time(self, group, name, fn, nbytes, ok):
        times = harness.time_rounds(fn, rounds=self.rounds, warmup=3, setup=self.flush)
        ms = harness.median_ms(times)
        gbs = nbytes / (ms * 1e-3) / 1e9
        self.rows.append((f"{group} · {name}", nbytes / 1e6, ms, gbs,
                          100 * nbytes / (ms * 1e-3) / self.copy_bps, ok))
        self.entries.append(harness.benchmark_entry(
            group, name, times, extra_info={"bytes": nbytes, "GB/s": gbs,
                                            "bits_equal": ok}))

    def print(self):
        w = max(len(r[0]) for r in self.rows)
        print(f"{'kernel':<{w}}  {'MB':>8}  {'ms':>8}  {'GB/s':>7}  {'copy%':>6}  bits")
        for name, mb, ms, gbs, pct, ok in self.rows:
            bits = "-" if ok is None else ("equal" if ok else "DIFFER")
            print(f"{name:<{w}}  {mb:8.1f}  {ms:8.3f}  {gbs:7.0f}  {pct:6.1f}  {bits}")


def check_rows(rep, n, d, k, sweep):
    x = rows_input(n, d, seed=0)
    tokens = rows_input(n // k, d, seed=1)
    idx = torch.randperm(n, device="cuda") // k  # (token, k) rows in expert order
    rows = ops.quantize_rows(x)
    ok = same_rows(rows, PF.quantize_rows(x))
    rep.time("quantize_rows", f"{n}x{d} bf16", lambda: ops.quantize_rows(x),
             n * d * 3 + 4 * n, ok)
    ok = same_rows(ops.quantize_rows(tokens, idx), PF.quantize_rows(tokens, idx))
    rep.time("quantize_rows", f"gather {n // k}->{n} rows", lambda: ops.quantize_rows(tokens, idx),
             n * d * 3 + 12 * n, ok)
    ok = same_packed(ops.quantize_rows_packed(tokens, idx), PF.quantize_rows_packed(tokens, idx),
                     d)
    rep.time("quantize_rows_packed", f"gather {n // k}->{n} rows",
             lambda: ops.quantize_rows_packed(tokens, idx), n * d * 3 + 24 * n, ok)
    for dtype in (torch.bfloat16, torch.float32):
        ok = same_bits(ops.dequantize_rows(rows, dtype), PF.dequantize_rows(rows, dtype))
        es = torch.tensor([], dtype=dtype).element_size()
        rep.time("dequantize_rows", f"{n}x{d} -> {str(dtype)[6:]}",
                 lambda dtype=dtype: ops.dequantize_rows(rows, dtype),
                 n * d * (1 + es) + 4 * n, ok)
    view = PF.unpack_rows_fp8(PF.quantize_rows_packed(x), d)
    ok = same_bits(ops.dequantize_rows(view, torch.bfloat16),
                   PF.dequantize_rows(view, torch.bfloat16))
    rep.time("dequantize_rows", "packed view -> bfloat16",
             lambda: ops.dequantize_rows(view, torch.bfloat16), n * d * 3 + 4 * n, ok)
    rep.time("reference", f"eager pure quantize_rows {n}x{d}", lambda: PF.quantize_rows(x),
             n * d * 3 + 4 * n, None)
    rep.time("reference", f"copy {n}x{d} bf16", lambda: x.clone(), n * d * 4, None)
    if sweep:
        for br, bc, nw in ((1, 2048, 4), (2, 2048, 8), (4, 2048, 8), (8, 2048, 8),
                           (4, 2048, 4), (2, 1024, 4), (4, 1024, 4), (4, 1024, 8),
                           (8, 1024, 8), (16, 512, 8), (8, 512, 4)):
            cfg = dict(block_r=br, block_c=bc, num_warps=nw)
            ok = same_rows(KF.launch_quantize_rows(x, **cfg), rows)
            rep.time("sweep quantize_rows", f"BLOCK_R={br} BLOCK_C={bc} warps={nw}",
                     lambda cfg=cfg: KF.launch_quantize_rows(x, **cfg), n * d * 3 + 4 * n, ok)
            ok = same_packed(KF.launch_quantize_rows_packed(tokens, idx, **cfg),
                             PF.quantize_rows_packed(tokens, idx), d)
            rep.time("sweep quantize_rows_packed gather",
                     f"BLOCK_R={br} BLOCK_C={bc} warps={nw}",
                     lambda cfg=cfg: KF.launch_quantize_rows_packed(tokens, idx, **cfg),
                     n * d * 3 + 24 * n, ok)


def check_activation(rep, n, i, act, layout):
    act_id, alpha, limit = PA.resolve_activation(act)
    kw = dict(act_id=act_id, alpha=alpha, limit=limit, layout_id=PA.resolve_layout(layout))
    g = torch.Generator(device="cuda").manual_seed(2)
    gu = (torch.randn(n, 2 * i, device="cuda", generator=g) * 3).bfloat16()
    gu[0] = 0.0
    w = torch.rand(n, device="cuda", generator=g).bfloat16()
    dh = (torch.randn(n, i, device="cuda", generator=g) * 1e-3).bfloat16()
    tag = f"{act} {layout} {n}x{2 * i}"

    h, res = ops.swiglu_packed_fwd(gu, w, **kw)
    rows, _ = ops.swiglu_packed_fwd_fp8(gu, w, **kw)
    ok = same_rows(rows, PF.quantize_rows(h))
    twin, _ = PF.swiglu_packed_fwd_fp8(gu, w, **kw)
    err = (PF.dequantize_rows(rows, torch.float32)
           - PF.dequantize_rows(twin, torch.float32)).abs().max().item()
    print(f"{tag}: swiglu_packed_fwd_fp8 vs the pure twin: {100 * _match(rows, twin):.3f}% "
          f"bytes equal, max |difference| of the values {err:.3g}")
    rep.time("swiglu_packed_fwd", f"bf16 {tag}", lambda: ops.swiglu_packed_fwd(gu, w, **kw),
             n * (4 * i + 2 * i + 2), None)
    rep.time("swiglu_packed_fwd_fp8", tag, lambda: ops.swiglu_packed_fwd_fp8(gu, w, **kw),
             n * (4 * i + i + 2 + 4), ok)

    dgu, dw = ops.swiglu_packed_bwd(res, dh)
    bwd_bytes = n * (4 * i + 2 * i + 2 + 4 * i + 2)
    rep.time("swiglu_packed_bwd", f"bf16 {tag}", lambda: ops.swiglu_packed_bwd(res, dh),
             bwd_bytes, None)
    for reread in (False, True):
        dgu8, drows, dw8 = KA.launch_swiglu_packed_bwd_fp8(gu, w, dh, *kw.values(), True,
                                                           reread=reread)
        ok = same_bits(dgu8, dgu) and same_rows(drows, PF.quantize_rows(dgu8))
        diff = (dw8.float() - dw.float()).abs().max().item()
        print(f"{tag}: swiglu_packed_bwd_fp8 ({'reread' if reread else 'recompute'}) "
              f"d_weights vs the bf16 kernel's: "
              f"{'same bits' if same_bits(dw8, dw) else 'bits differ'}, max |difference| "
              f"{diff:.3g} (max |d_weights| {dw.float().abs().max():.3g})")
        rep.time("swiglu_packed_bwd_fp8", f"{tag} {'reread' if reread else 'recompute'}",
                 lambda reread=reread: KA.launch_swiglu_packed_bwd_fp8(
                     gu, w, dh, *kw.values(), True, reread=reread),
                 bwd_bytes + n * (2 * i + 4), ok)


def _match(a, b) -> float:
    return (_bytes(a.q) == _bytes(b.q)).float().mean().item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="time the quantise block configs")
    ap.add_argument("--out", default=None, help="JSON (the suite's format)")
    a = ap.parse_args(argv)
    if not harness.HAS_CUDA:
        print("needs a CUDA device", file=sys.stderr)
        return 2
    env = harness.environment()
    print(", ".join(f"{k} {v}" for k, v in env.items()))
    copy_bps = harness.copy_ceiling_bytes()
    print(f"device copy: {copy_bps / 1e9:.0f} GB/s (bytes read + written)")
    rep = Report(a.rounds, copy_bps)
    with torch.no_grad():
        check_rows(rep, a.rows, a.hidden, a.top_k, a.sweep)
        for act, layout in (("swiglu", "halves"), ("swiglu_oai", "interleaved")):
            check_activation(rep, a.rows, a.inter, act, layout)
    rep.print()
    harness.write_benchmark_json(a.out, rep.entries, copy_GBps=copy_bps / 1e9)
    return 0 if all(r[5] is not False for r in rep.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
