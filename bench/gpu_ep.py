"""Expert parallelism on several GPUs of one host (torchrun, NCCL; DeepEP where importable).

    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/gpu_ep.py --out ep.json

1. Parity: each EP backend (all_to_all over NCCL, deepep) against a local layer holding
   every expert that computes all ranks' tokens: outputs and every gradient.
2. The Qwen3-30B-A3B layer (H 2048, I 768, E 128, top-8, bf16, --tokens per rank):
   - layer forward and backward per backend;
   - exchange throughput: permute + exchange + unpermute against raw all_to_all_single of
     the same payload, and DeepEP dispatch/combine; for the row all_to_alls also from a
     busy GPU (the moves' GPU time, the host's launches queued ahead);
   - recompute: forward + checkpointed recompute + backward with the combine skip
     on and off; fresh dispatch (layout + dispatch) against a cached one; the forward combine;
     a profiler table of the kernels whose time differs most between skip off and on;
   - overlap: layer backward with overlap_weight_grad on/off at comm_num_sm 12,
     20, 24; the backward combine and the dW GEMMs alone; a profiler count of the time
     communication kernels ran concurrently with the dW GEMMs.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import moe_fn
from bench.harness import CLOCK, entries_from_tables, environment, write_benchmark_json
from moe_fn import MoEConfig, MoELayer
from moe_fn.autograd.routing import Combine
from moe_fn.pure.activations import resolve_layout
from moe_fn.pure.experts import experts_bwd_input, experts_bwd_weight, experts_fwd
from moe_fn.resources import release_comm_resources

RANK = WORLD = 0


def say(*a):
    if RANK == 0:
        print(*a, flush=True)


def time_once(fn, busy_cycles=0):
    """One ranks-synchronised timing of ``fn()`` by the suite's CUDA-event clock: the max
    over ranks, in ms. With ``busy_cycles`` the GPU first sleeps that long, so that the host
    has queued ``fn``'s work before the clock starts (as when other layers' work runs
    ahead): the time the GPU takes, without waiting for the host."""
    torch.cuda.synchronize()
    dist.barrier()
    if busy_cycles:
        torch.cuda._sleep(busy_cycles)
    start = CLOCK()
    fn()
    t = torch.tensor([(CLOCK() - start) * 1e3], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn, reps=20, warmup=5, busy_cycles=0):
    """Median ms of ``time_once(fn, busy_cycles)`` after warm-up."""
    for _ in range(warmup):
        fn()
    return statistics.median(time_once(fn, busy_cycles) for _ in range(reps))


ONLY_BACKENDS = None  # --backends: a subset to run


def backends(have_deepep):
    # "all_to_all_symm": the symm_mem exchange (comm_backend="symm_mem");
    # "all_to_all_symm_rowwise": the same, reading a token once per row, not once per rank.
    names = (["all_to_all", "all_to_all_symm", "all_to_all_symm_rowwise"]
             + (["deepep"] if have_deepep else []))
    if ONLY_BACKENDS is None:
        return names
    return [b for b in ONLY_BACKENDS if b in names]  # in the order given


@functools.cache
def comm_group(sms):
    """An NCCL group whose kernels use at most ``sms`` CTAs, matching the GEMMs' carveout
    (without a cap NCCL may take more SMs than the carveout leaves free)."""
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.max_ctas = sms
    opts.config.min_ctas = min(sms, 4)
    return dist.new_group(list(range(WORLD)), pg_options=opts)


def build(cfg_kw, backend, seed=0, group=None, **extra):
    torch.manual_seed(seed)
    e = cfg_kw["num_experts"]
    full = MoEConfig(**cfg_kw)
    gu = torch.randn(e, 2 * full.intermediate_size, full.hidden_size, device="cuda") * 0.02
    dn = torch.randn(e, full.hidden_size, full.intermediate_size, device="cuda") * 0.02
    rw = torch.randn(e, full.hidden_size, device="cuda") * 0.05
    rowwise = backend == "all_to_all_symm_rowwise"
    if backend.startswith("all_to_all_symm"):
        backend = "symm_mem"
    cfg = MoEConfig(**cfg_kw, comm_backend=backend, ep_size=WORLD, **extra)
    layer = MoELayer(cfg, group, device="cuda", dtype=torch.bfloat16)
    if rowwise:
        layer.exchange.read_tokens_once = False
    el = cfg.num_local_experts
    with torch.no_grad():
        layer.router.weight.copy_(rw)
        layer.experts.gate_up_proj.copy_(gu[RANK * el:(RANK + 1) * el])
        layer.experts.down_proj.copy_(dn[RANK * el:(RANK + 1) * el])
    return layer, (rw, gu, dn)


def parity(have_deepep, results):
    kw = dict(hidden_size=2048, intermediate_size=256, num_experts=16, top_k=4)
    t = 512
    for backend in backends(have_deepep):
        layer, (rw, gu, dn) = build(kw, backend)
        ref = MoELayer(MoEConfig(**kw, impl=layer.config.impl), device="cuda",
                       dtype=torch.bfloat16)
        with torch.no_grad():
            ref.router.weight.copy_(rw)
            ref.experts.gate_up_proj.copy_(gu)
            ref.experts.down_proj.copy_(dn)
        torch.manual_seed(100)
        xs = torch.randn(WORLD, t, 2048, device="cuda", dtype=torch.bfloat16)
        dys = torch.randn_like(xs)
        x_all = xs.reshape(-1, 2048).clone().requires_grad_()
        ref(x_all).backward(dys.reshape(-1, 2048))
        out_all = ref(x_all.detach()).float()
        x = xs[RANK].clone().requires_grad_()
        out = layer(x)
        out.backward(dys[RANK])
        el = layer.config.num_local_experts
        sl = slice(RANK * el, (RANK + 1) * el)
        rg = layer.router.weight.grad.float().clone()
        dist.all_reduce(rg)

        def rel(a, b):
            return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        diffs = {
            "out": rel(out, out_all[RANK * t:(RANK + 1) * t]),
            "x_grad": rel(x.grad, x_all.grad[RANK * t:(RANK + 1) * t]),
            "router_grad": rel(rg, ref.router.weight.grad),
            "gate_up_grad": rel(layer.experts.gate_up_proj.grad,
                                ref.experts.gate_up_proj.grad[sl]),
            "down_grad": rel(layer.experts.down_proj.grad, ref.experts.down_proj.grad[sl]),
        }
        worst = torch.tensor([max(diffs.values())], device="cuda")
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        diffs["worst_over_ranks"] = worst.item()
        results["parity"][backend] = diffs
        say(f"parity {backend} vs local: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))


QWEN = dict(hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8)


def dispatch_once(layer, x):
    """Route ``x`` and dispatch it as the layer's forward does (the weights stay home where
    the layer weights at home). Returns ``(w, sent_w, plan, rows, row_w, handle)``."""
    ex = layer.exchange
    _, idx, w = layer.route(x)
    plan = moe_fn.layer.make_route_plan(idx, layer.config.num_experts)
    sent_w = None if layer._weight_placement()[0] else w
    rows, row_w, handle = ex.dispatch(x, sent_w, ex.layout(plan))
    return w, sent_w, plan, rows, row_w, handle


def layer_bench(have_deepep, results, tokens, reps):
    flops = 2 * tokens * 8 * 2048 * 3 * 768
    for backend in backends(have_deepep):
        layer, _ = build(QWEN, backend)
        x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)

        def fwd():
            return layer(x)

        def fwd_bwd():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            layer(x).backward(dy)
        tf, tfb = timed(fwd, reps), timed(fwd_bwd, reps)
        row = {"fwd_ms": tf, "bwd_ms": tfb - tf, "tflops_fwd": flops / tf / 1e9,
               "tflops_bwd": 2 * flops / (tfb - tf) / 1e9}
        results["layer"][backend] = row
        say(f"layer EP{WORLD} {backend}: {row}")

        # Exchange alone: the moves of one forward (dispatch, then combine) against raw
        # all_to_all_single of the same bytes.
        ex = layer.exchange
        with torch.no_grad():
            w, sent_w, plan, rows, row_w, handle = dispatch_once(layer, x)
            home_w, fold_w = layer._weight_placement()

            def fresh():
                p = moe_fn.layer.make_route_plan(plan.topk_idx, layer.config.num_experts)
                ex.dispatch(x, sent_w, ex.layout(p))

            def cached():
                ex.dispatch(x, sent_w, handle, cached=True)

            def combine(needs_grad=True):  # as the layer's forward combines, weights where
                # it puts them, keeping what a backward needs unless told it will not run
                Combine.apply(rows, ex, handle, w if home_w else row_w if fold_w else None,
                              needs_grad)
            t_fresh, t_cached, t_comb = timed(fresh, reps), timed(cached, reps), timed(combine,
                                                                                       reps)
            # The same from a busy GPU (1 ms queued first): the moves' GPU time, where the
            # host's launches do not hold them up (this project's hosts are slow enough
            # that an idle start waits for them).
            busy = _sleep_cycles(1.0)
            t_cached_busy, t_comb_busy = timed(cached, reps, busy_cycles=busy), timed(
                combine, reps, busy_cycles=busy)
            no_grad = {}
            if home_w:
                # Without a backward to come (a reentrant checkpoint's first forward) the
                # home-weighted combine reads the own rows in place: both, interleaved.
                kept, in_place = interleaved_times(
                    [(None, combine), (None, lambda: combine(False))], reps)
                no_grad = {"combine_keeping_rows_ms": statistics.median(kept),
                           "combine_no_grad_ms": statistics.median(in_place)}
        # Bytes that cross between ranks, bf16: rows (all_to_all) or tokens (DeepEP)
        # not kept locally.
        if backend.startswith("all_to_all_symm"):  # the route's rows for other ranks' experts
            per_rank = plan.counts.reshape(WORLD, -1).sum(1).tolist()
            sent_rows = sum(per_rank) - per_rank[RANK]
        elif backend.startswith("all_to_all"):
            sent_rows = sum(handle.send_splits) - handle.send_splits[RANK]
        else:  # DeepEP receives this rank's own tokens too: count only the others'
            el = layer.config.num_local_experts
            own = int(((plan.topk_idx // el) == RANK).any(1).sum())
            sent_rows = handle.num_recv_tokens - own
        payload = sent_rows * 2048 * 2
        row = {"fresh_dispatch_ms": t_fresh, "cached_dispatch_ms": t_cached,
               "combine_ms": t_comb, "cached_speedup": t_fresh / t_cached,
               "rows_per_rank": rows.shape[0], "dispatch_gbs": payload / t_cached / 1e6,
               "combine_gbs": payload / t_comb / 1e6, **no_grad,
               "cached_dispatch_busy_ms": t_cached_busy, "combine_busy_ms": t_comb_busy}
        if backend.startswith("all_to_all"):
            # Raw all_to_all_single of the (token, expert) rows this route moves between
            # ranks (what crosses NVLink row by row), and of every row including each
            # rank's own (what a plain implementation sends).
            full_send = plan.counts.reshape(WORLD, -1).sum(1)
            full_recv = torch.empty_like(full_send)
            dist.all_to_all_single(full_recv, full_send)
            full_send, full_recv = full_send.tolist(), full_recv.tolist()
            rem_send, rem_recv = list(full_send), list(full_recv)
            rem_send[RANK] = rem_recv[RANK] = 0
            raws = [("raw_remote", rem_send, rem_recv), ("raw_all", full_send, full_recv)]
            for name, ss, rs in raws:
                send = torch.randn(sum(ss), 2048, device="cuda", dtype=torch.bfloat16)
                recv = torch.empty(sum(rs), 2048, device="cuda", dtype=torch.bfloat16)

                def raw():
                    dist.all_to_all_single(recv, send, list(rs), list(ss))
                t_raw = timed(raw, reps)
                t_raw_busy = timed(raw, reps, busy_cycles=busy)
                row[f"{name}_all_to_all_ms"] = t_raw
                row[f"{name}_all_to_all_busy_ms"] = t_raw_busy
                row[f"dispatch_vs_{name}"] = t_raw / t_cached
                row[f"combine_vs_{name}"] = t_raw / t_comb
                row[f"dispatch_busy_vs_{name}"] = t_raw_busy / t_cached_busy
                row[f"combine_busy_vs_{name}"] = t_raw_busy / t_comb_busy
                for key in no_grad:
                    row[f"{key[:-3]}_vs_{name}"] = t_raw / no_grad[key]
        results["exchange"][backend] = row
        say(f"exchange {backend}: {row}")


def recompute_bench(have_deepep, results, tokens, reps):
    """Forward + checkpointed recompute + backward with the skip off and on: the two
    layers interleaved rep by rep, saving = median of the paired differences."""
    for backend in backends(have_deepep):
        layers = [build(QWEN, backend,
                        skip_recompute_combine=skip)[0] for skip in (False, True)]
        x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)

        def step(layer):
            for p in layer.parameters():
                p.grad = None
            moe_fn.checkpoint(lambda h: h + layer(h), x).backward(dy)
        for layer in layers:
            layer.exchange.reset_counters()
        off, on = interleaved_times([(None, lambda lay=lay: step(lay)) for lay in layers],
                                    3 * reps)
        for skip, layer, times in ((False, layers[0], off), (True, layers[1], on)):
            c = dict(layer.exchange.counters)
            results["recompute"][f"{backend} skip={skip}"] = {
                "fwd_recompute_bwd_ms": statistics.median(times), "counters": c}
            say(f"recompute {backend} skip={skip}: {statistics.median(times):.3f} ms "
                f"counters {c}")
        saved = statistics.median(a - b for a, b in zip(off, on))
        comb = results["exchange"][backend]["combine_ms"]
        results["recompute"][f"{backend} saved"] = {
            "paired_saving_ms": saved, "forward_combine_ms": comb,
            "saved_fraction_of_combine": saved / comb}
        say(f"recompute {backend}: skip saves {saved:.3f} ms (paired median) of a "
            f"{comb:.3f} ms combine")
        # Diagnostics: a failure of one must not cost the other or the sections after.
        for name, diagnostic in (
                ("phases", lambda: recompute_phases(backend, layers, x, dy, 2 * reps, results)),
                ("phases busy", lambda: recompute_phases(backend, layers, x, dy, 2 * reps,
                                                         results, busy_ms=1.0)),
                ("kernels", lambda: recompute_kernels(
                    backend, [lambda lay=lay: step(lay) for lay in layers], results))):
            try:
                diagnostic()
            except Exception as e:  # noqa: BLE001
                say(f"recompute {backend} {name} failed: {type(e).__name__}: {e}")


_COMBINE_FWD = ("combine",)


def recompute_phases(backend, layers, x, dy, reps, results, *, busy_ms=0.0):
    """The step split where it happens, by CUDA events on the stream (this rank): the
    forward, the recompute, the rest of the backward, and the forward combine inside the
    skip-off recompute. A phase's interval is its time on the GPU's timeline, including
    any wait for the host, which is what the skip can save; the standalone combine timing
    above starts from an idle GPU instead. Also in place: the forward's fresh dispatch
    (route plan, layout and dispatch, as the exchange section's standalone timing) and the
    recompute's cached dispatch.

    With one layer per step the GPU is idle whenever a layer call starts, so the host's
    time shows in every interval. ``busy_ms`` > 0 queues that much GPU work (a sleep
    kernel) before each call of the layer, as the other layers of a model would: the host
    then runs ahead and an interval holds the host only where the layer waits for it (a
    host sync)."""
    cycles = _sleep_cycles(busy_ms) if busy_ms else 0
    marks = []
    dmarks = []  # (tag, event): the dispatches' own marks, apart from the phase marks

    def dmark(tag):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        dmarks.append((tag, ev))

    real_plan = moe_fn.layer.make_route_plan

    def plan_marked(*a, **kw):
        dmark("plan")
        return real_plan(*a, **kw)
    moe_fn.layer.make_route_plan = plan_marked

    def mark():
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append(ev)

    for layer in layers:
        for name in _COMBINE_FWD:
            real = getattr(layer.exchange, name, None)
            if real is None:
                continue

            def wrapped(*a, _real=real, **kw):
                mark()
                out = _real(*a, **kw)
                mark()
                return out
            setattr(layer.exchange, name, wrapped)

        def dispatch_marked(*a, _real=layer.exchange.dispatch, cached=False, **kw):
            dmark("cached" if cached else "fresh")
            out = _real(*a, cached=cached, **kw)
            dmark("end")
            return out
        layer.exchange.dispatch = dispatch_marked

    def block(layer):
        def fn(h):
            if cycles:
                torch.cuda._sleep(cycles)
            mark()
            out = h + layer(h)
            mark()
            return out
        return fn

    phases = [{"forward": [], "recompute": [], "backward_rest": [], "recompute_combine": [],
               "fresh_dispatch": [], "cached_dispatch": []} for _ in layers]
    try:
        for rep in range(reps + 3):
            for arm, layer in enumerate(layers):
                for p in layer.parameters():
                    p.grad = None
                torch.cuda.synchronize()
                dist.barrier()
                marks.clear()
                dmarks.clear()
                moe_fn.checkpoint(block(layer), x).backward(dy)
                mark()
                torch.cuda.synchronize()
                # Forward: fn start, combine start and end, fn end; the recompute: fn start,
                # its combine's two marks unless skipped, fn end; the backward's end.
                expected = 9 if arm == 0 else 7
                if len(marks) != expected:
                    raise RuntimeError(f"arm {arm}: {len(marks)} marks, expected {expected}: "
                                       "the layer's combine took another path")
                if rep < 3:
                    continue
                f0, f1 = marks[0], marks[3]
                r0, r1 = marks[4], marks[-2]
                ph = phases[arm]
                ph["forward"].append(f0.elapsed_time(f1))
                ph["recompute"].append(r0.elapsed_time(r1))
                ph["backward_rest"].append(r1.elapsed_time(marks[-1]))
                if len(marks) == 9:  # the recompute's combine ran
                    ph["recompute_combine"].append(marks[5].elapsed_time(marks[6]))
                tags = [t for t, _ in dmarks]
                if tags != ["plan", "fresh", "end", "cached", "end"]:
                    raise RuntimeError(f"arm {arm}: dispatch marks {tags}, expected one "
                                       "fresh dispatch in the forward, one cached in the "
                                       "recompute")
                ph["fresh_dispatch"].append(dmarks[0][1].elapsed_time(dmarks[2][1]))
                ph["cached_dispatch"].append(dmarks[3][1].elapsed_time(dmarks[4][1]))
    finally:
        moe_fn.layer.make_route_plan = real_plan
        for layer in layers:
            for name in (*_COMBINE_FWD, "dispatch"):
                layer.exchange.__dict__.pop(name, None)
    med = [{k: statistics.median(v) if v else None for k, v in ph.items()} for ph in phases]
    off, on = phases
    saved = statistics.median(a - b for a, b in zip(off["recompute"], on["recompute"]))
    cost = statistics.median(b - a for a, b in zip(off["backward_rest"], on["backward_rest"]))
    comb = med[0]["recompute_combine"]
    summary = {"skip_off_ms": med[0], "skip_on_ms": med[1],
               "recompute_saving_ms": saved, "backward_cost_ms": cost,
               "combine_in_recompute_ms": comb,
               "saving_net_of_backward_cost_ms": saved - cost,
               "net_saving_fraction_of_combine_in_recompute": (saved - cost) / comb,
               "fresh_dispatch_in_place_ms": med[0]["fresh_dispatch"],
               "cached_dispatch_in_place_ms": med[0]["cached_dispatch"],
               "cached_speedup_in_place": statistics.median(
                   a / b for a, b in zip(off["fresh_dispatch"], off["cached_dispatch"]))}
    tag = f"{backend} phases" + (f" busy {busy_ms} ms" if busy_ms else "")
    results["recompute"][tag] = summary
    say(f"recompute {tag}: off {med[0]}, on {med[1]}")
    say(f"recompute {tag}: the recompute's combine took {comb:.3f} ms; the skip "
        f"saves {saved:.3f} ms of the recompute and adds {cost:.3f} ms to the backward "
        f"(net {saved - cost:.3f} ms = {(saved - cost) / comb:.0%} of that combine)")
    say(f"recompute {tag} dispatch in place: fresh {med[0]['fresh_dispatch']:.3f} ms, "
        f"cached {med[0]['cached_dispatch']:.3f} ms "
        f"({summary['cached_speedup_in_place']:.1f}x)")


def _sleep_cycles(ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the GPU busy for about ``ms``."""
    probe = 1_000_000
    torch.cuda._sleep(probe)  # warm-up
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(probe)
    e.record()
    torch.cuda.synchronize()
    return int(probe * ms / s.elapsed_time(e))


def kernel_times(step_fn, reps=5):
    """Per-kernel GPU time (µs per step) of ``step_fn`` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    step_fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step_fn()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.key[:90]
            times[name] = times.get(name, 0.0) + ev.self_device_time_total / reps
    return times


def recompute_kernels(backend, steps, results):
    """Where the skip's saving goes: each arm's kernel time per step and the kernels whose
    time differs most between skip off and on (this rank; every rank runs the same)."""
    off, on = (kernel_times(fn) for fn in steps)
    rows = sorted(((n, off.get(n, 0.0), on.get(n, 0.0)) for n in set(off) | set(on)),
                  key=lambda r: -abs(r[1] - r[2]))
    summary = {"kernel_us_per_step_skip_off": sum(off.values()),
               "kernel_us_per_step_skip_on": sum(on.values()),
               "largest_differences": [{"kernel": n, "skip_off_us": a, "skip_on_us": b}
                                       for n, a, b in rows[:12]]}
    results["recompute"][f"{backend} kernels"] = summary
    say(f"recompute {backend} kernels: {summary['kernel_us_per_step_skip_off']:.0f} us off, "
        f"{summary['kernel_us_per_step_skip_on']:.0f} us on per step")
    for n, a, b in rows[:6]:  # the rest are in the results file
        say(f"recompute {backend} kernel {b - a:+8.1f} us  ({a:7.1f} -> {b:7.1f})  {n}")


def interleaved_times(arms, reps, warmup=5):
    """CUDA-event times (max over ranks per rep) of each arm's ``timed()``, after its
    untimed ``setup()`` (or None), the arms interleaved rep by rep so that drift of the
    shared machine hits every arm alike."""
    times = [[] for _ in arms]
    for rep in range(warmup + reps):
        for i, (setup, timed_fn) in enumerate(arms):
            if setup is not None:
                setup()
            t = time_once(timed_fn)
            if rep >= warmup:
                times[i].append(t)
    return times


def backward_times(layers, x, dy, reps, warmup=5):
    """Backward-only times of each layer, interleaved; the forward runs untimed."""
    outs = {}

    def forward(i, layer):
        for p in layer.parameters():
            p.grad = None
        outs[i] = layer(x)
    return interleaved_times([(lambda i=i, lay=lay: forward(i, lay),
                               lambda i=i: outs.pop(i).backward(dy))
                              for i, lay in enumerate(layers)], reps, warmup)


def overlap_bench(have_deepep, results, tokens, reps):
    for backend in backends(have_deepep):
        # all_to_all: the backward combine's gathers on a side stream (the library's
        # default) or on the compute stream around NCCL's asynchronous transfer.
        # (The symm_mem exchange's pulls are kernels of their own: side stream only.)
        modes = (True, False) if backend == "all_to_all" else (None,)
        for sms, side in itertools.product((12, 20, 24), modes):
            group = comm_group(sms) if backend.startswith("all_to_all") else None
            arms = [build(QWEN, backend, group=group,
                          overlap_weight_grad=overlap, comm_num_sm=sms)[0]
                    for overlap in (False, True)]
            if side is not None:
                arms[1].exchange.combine_on_side_stream = side
            x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True)
            dy = torch.randn_like(x)
            serial, overlapped = backward_times(arms, x, dy, 3 * reps)
            row = {"serial": statistics.median(serial),
                   "overlap": statistics.median(overlapped),
                   "paired_saving_ms": statistics.median(
                       a - b for a, b in zip(serial, overlapped)),
                   "serial_spread_ms": [min(serial), max(serial)]}
            layer = arms[1]
            # The two pieces alone: dW GEMMs and the backward combine (dispatch backward).
            ex = layer.exchange
            with torch.no_grad():
                *_, rows, row_w, handle = dispatch_once(layer, x)
                d_rows = torch.randn_like(rows)
                c = layer.config
                act_id, alpha, limit = c.act_static
                _, res = experts_fwd(rows, layer.experts.gate_up_proj, layer.experts.down_proj,
                                     handle.local_offs, act_id=act_id, alpha=alpha,
                                     limit=limit, layout_id=resolve_layout(c.gate_up_layout),
                                     fused=c.gate_up_impl == "fused")
                _, _, work = experts_bwd_input(res, d_rows)
                t_dw = timed(lambda: experts_bwd_weight(work), reps)
                t_comb = timed(lambda: ex.dispatch_backward(handle, d_rows, row_w), reps)
            hidden = row["paired_saving_ms"] / min(t_dw, t_comb)
            row.update({"dW_ms": t_dw, "bwd_combine_ms": t_comb, "hidden_fraction": hidden})
            try:  # a diagnostic: its failure must not cost the rest of the section
                dw_in, comb_in = serial_pieces_in_place(arms[0], x, dy, reps)
                row.update({"dW_in_place_ms": dw_in, "bwd_combine_in_place_ms": comb_in,
                            "hidden_fraction_in_place":
                                row["paired_saving_ms"] / min(dw_in, comb_in)})
            except Exception as e:  # noqa: BLE001
                say(f"overlap {backend}: in-place timing failed: {type(e).__name__}: {e}")
            tag = "" if side is None else f" side_stream={side}"
            results["overlap"][f"{backend} sm={sms}{tag}"] = row
            say(f"overlap {backend} comm_num_sm={sms}{tag}: {row}")
        trace_overlap(layer, x, dy, results, backend)


def serial_pieces_in_place(layer, x, dy, reps):
    """Median ms of the serial backward's dW GEMMs and of its backward combine where they
    run, by stream events around each call (this rank). In a backward the host runs ahead
    of the GPU, so these are the pieces' times on the GPU's timeline, which is what an
    overlap can hide; the standalone timings start from an idle GPU and include the host
    time before their first kernel."""
    import moe_fn.pure.experts as pure_experts
    pending, times = [], {"dw": [], "comb": []}

    def around(key, fn):
        def wrapped(*a, **kw):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = fn(*a, **kw)
            e.record()
            pending.append((key, s, e))
            return out
        return wrapped
    real_dw = pure_experts.experts_bwd_weight
    pure_experts.experts_bwd_weight = around("dw", real_dw)
    layer.exchange.dispatch_backward = around("comb", layer.exchange.dispatch_backward)
    try:
        for rep in range(reps + 2):
            for p in layer.parameters():
                p.grad = None
            out = layer(x)
            pending.clear()
            out.backward(dy)
            torch.cuda.synchronize()
            if rep >= 2:
                for key, s, e in pending:
                    times[key].append(s.elapsed_time(e))
    finally:
        pure_experts.experts_bwd_weight = real_dw
        layer.exchange.__dict__.pop("dispatch_backward", None)
    if not times["dw"] or not times["comb"]:
        raise RuntimeError(f"the serial backward did not pass the wrapped calls: {times}")
    return statistics.median(times["dw"]), statistics.median(times["comb"])


# Kernels that move rows between ranks: NCCL's, DeepEP's, the symm_mem exchange's
# pulls and barriers; lower case, as the names they are matched against.
_COMM_KERNELS = ("nccl", "deep_ep", "intranode", "_pull_", "barrier")


def trace_overlap(layer, x, dy, results, backend):
    """Time during which a communication kernel and a grouped GEMM ran at once (rank 0)."""
    from torch.profiler import ProfilerActivity, profile
    for p in layer.parameters():
        p.grad = None
    layer(x).backward(dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for p in layer.parameters():
            p.grad = None
        layer(x).backward(dy)
        torch.cuda.synchronize()
    comm, gemm = [], []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name.lower()
        span = (ev.time_range.start, ev.time_range.end)
        if any(k in name for k in _COMM_KERNELS) or "combine" in name:
            comm.append(span)
        elif "cutlass" in name or "gemm" in name:
            gemm.append(span)
    both = sum(max(0, min(a1, b1) - max(a0, b0)) for a0, a1 in comm for b0, b1 in gemm)
    summary = {"comm_kernel_us": sum(b - a for a, b in comm),
               "gemm_kernel_us": sum(b - a for a, b in gemm),
               "concurrent_us": both,
               "comm_kernels": sorted({e.name[:60] for e in prof.events()
                                       if any(k in e.name.lower() for k in
                                              _COMM_KERNELS)})[:6]}
    results["overlap"][f"{backend} trace"] = summary
    say(f"trace {backend}: {summary}")


def main():
    global RANK, WORLD, ONLY_BACKENDS
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="parity,layer,recompute,overlap")
    ap.add_argument("--backends", default=None,
                    help="comma-separated subset of all_to_all, "
                         "all_to_all_symm, all_to_all_symm_rowwise, "
                         "deepep")
    a = ap.parse_args()
    ONLY_BACKENDS = a.backends.split(",") if a.backends else None
    dist.init_process_group("nccl")
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", RANK)))
    try:
        import deep_ep  # noqa: F401
        have_deepep = True
    except ImportError as e:
        have_deepep = False
        say(f"DeepEP not importable ({e}); all_to_all only")
    results = {"env": environment(), "world": WORLD, "tokens_per_rank": a.tokens,
               "parity": {}, "layer": {}, "exchange": {}, "recompute": {}, "overlap": {}}
    only = a.only.split(",")

    def dump():  # after every section, so a run cut short keeps what it measured
        if RANK == 0 and a.out:
            # The suite's format: its tables' times as benchmarks, the tables beside them.
            entries = entries_from_tables(
                {k: v for k, v in results.items() if isinstance(v, dict) and k != "env"},
                prefix=f"ep{WORLD}", note=f"median over --reps {a.reps}, max over ranks")
            write_benchmark_json(a.out, entries, **results)
    if "parity" in only:
        parity(have_deepep, results)
        dump()
    if "layer" in only or "recompute" in only:
        layer_bench(have_deepep, results, a.tokens, a.reps)
        dump()
    if "recompute" in only:
        recompute_bench(have_deepep, results, a.tokens, a.reps)
        dump()
    if "overlap" in only:
        overlap_bench(have_deepep, results, a.tokens, a.reps)
        dump()
    dist.barrier()
    release_comm_resources()  # while NCCL lives
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
