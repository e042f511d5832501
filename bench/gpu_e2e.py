"""End-to-end training steps of a Qwen3-MoE-like model converted by moe_fn.hf.convert.

    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/gpu_e2e.py \
        --out $OUT/e2e.json
    python bench/gpu_e2e.py --single --out $OUT/e2e_single.json
    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/gpu_e2e.py \
        --tiny --device cpu --out /tmp/e2e.json        # the logic, on CPUs over gloo

Model (from a config, random weights, no download): 4 layers, hidden 2048, 16 heads of 128
with 4 KV heads, 128 experts top-8 of moe_intermediate 768, vocab 32000, sequence 4096,
micro-batch 1 per rank, bf16, AdamW (fused; --optimizer foreach), HF gradient checkpointing
(use_reentrant=True).

EP mode (torchrun, NCCL; every rank holds E/ep experts and the replicated dense weights;
each rank trains on its own tokens, the dense gradients are not all-reduced, which costs
every arm alike): one model + optimizer per arm, all built from the same initial weights:
``off`` (separate gate+up, the reference weighting and combine, no overlap, no skip), each
option alone (``fused_gate_up``, ``overlap`` with comm_num_sm 20, ``skip``,
``fused_weighting`` = ``impl="fused"``: fused row weighting and combine), ``all_on``, and
``all_on_kept`` (all on, but the MoE layers keep their activations instead of being
recomputed: ``recompute_in_checkpoint=False``, which leaves the skip nothing to skip). Arms
run round-robin (one step of each arm, then the next step) so clock and thermal drift hit
every arm alike; every arm sees the same batches. Per arm: the median step time (CUDA events
around zero_grad + forward + backward + optimizer step, max over ranks), its steps' peak
memory above what every arm keeps resident (activations, gradients, temporaries), and every
step's loss (mean over ranks): step 1 losses agree across arms up to bf16 rounding.

``--single`` (one GPU, no torchrun): the unconverted model with transformers' grouped_mm
experts against the converted model on the local backend (every ep-1 option on; and
``moe_fn_local_kept``, not recomputing the MoE layers; ``moe_fn_local_fp8``, the FP8
experts), and a bound with the MoE blocks removed; same harness.

An arm that runs out of memory is recorded as such and dropped (building it, or during a
step: the whole round is then checked across ranks). Results are rewritten to the JSON
after every phase, so a run cut short still leaves what it measured; a PNG of the step
times goes beside it.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import CudaEventClock, benchmark_entry, write_benchmark_json
from moe_fn.hf import convert
from moe_fn.resources import release_comm_resources

RANK, WORLD = 0, 1

FULL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=4, head_dim=128,
            moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
            norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
            decoder_sparse_step=1, mlp_only_layers=[])
TINY = dict(FULL, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=256)

OFF = dict(gate_up_impl="separate", impl="reference", overlap_weight_grad=False,
           skip_recompute_combine=False)


def ep_arms(comm_num_sm: int, comm: str) -> dict[str, dict]:
    arms = {
        "off": OFF,
        "fused_gate_up": OFF | dict(gate_up_impl="fused"),
        "overlap": OFF | dict(overlap_weight_grad=True, comm_num_sm=comm_num_sm),
        "skip": OFF | dict(skip_recompute_combine=True),
        "fused_weighting": OFF | dict(impl="fused"),
        "all_on": dict(gate_up_impl="fused", impl="fused", overlap_weight_grad=True,
                       comm_num_sm=comm_num_sm, skip_recompute_combine=True),
    }
    # Every option on, but the MoE layers keep their activations instead of being
    # recomputed (memory for speed; the skip has nothing left to skip).
    arms["all_on_kept"] = arms["all_on"] | dict(skip_recompute_combine=False,
                                                recompute_in_checkpoint=False)
    if comm == "deepep":
        arms = {k: v | dict(comm_backend="deepep") for k, v in arms.items()}
    if comm == "all_to_all_symm":
        arms = {k: v | dict(comm_backend="symm_mem") for k, v in arms.items()}
    return arms


SINGLE_ON = dict(gate_up_impl="fused", impl="fused", skip_recompute_combine=True)
FP8 = dict(expert_precision="fp8_rowwise")


def say(*a):
    if RANK == 0:
        print(*a, flush=True)


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def all_ok(ok: bool, device) -> bool:
    """Whether every rank is ok (a collective: every rank must call it)."""
    if WORLD == 1:
        return ok
    t = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() == 0.0


def reduce_max(x: float, device) -> float:
    if WORLD == 1:
        return x
    t = torch.tensor([x], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def reduce_mean(x: float, device) -> float:
    if WORLD == 1:
        return x
    t = torch.tensor([x], device=device, dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / WORLD


def build_reference(args, device, dtype):
    import transformers

    cfg = transformers.Qwen3MoeConfig(**(TINY if args.tiny else FULL))
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(args.seed)  # same seed on every rank: replicated initial weights
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(cfg)
    return model.to(dtype)


class _MoERemoved(torch.nn.Module):
    """Stands in for a sparse MoE block: adds nothing to the residual stream."""

    def forward(self, hidden_states):
        return torch.zeros_like(hidden_states)


def make_arm(ref, options, *, how: str, ep: int, group, optimizer: str):
    """``how``: "hf" (as built), "convert" (moe_fn.hf.convert with ``options``) or
    "remove_moe" (every sparse MoE block replaced by zeros: the rest of the step alone,
    experts neither run nor updated — the floor under any MoE implementation's step)."""
    model = copy.deepcopy(ref)
    if how == "convert":
        convert(model, process_group=group, ep_size=ep, **options)
    elif how == "remove_moe":
        for layer in model.model.layers:
            if hasattr(layer.mlp, "experts"):
                layer.mlp = _MoERemoved()
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    # "fused": one kernel pass per parameter group (TorchTitan's default); "foreach": a
    # pass per arithmetic step, which for the 2.4 B expert parameters on one GPU costs
    # ~30 ms a step; "loop": one tensor at a time (CPU runs).
    impl = {"fused": dict(fused=True), "foreach": dict(foreach=True),
            "loop": dict(foreach=False)}[optimizer]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, **impl)
    return model, opt


def batches(args, n: int, vocab: int, seq: int, device):
    """Step i's tokens on this rank: the same for every arm, different per rank."""
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + 7919 * i + RANK)
        out.append(torch.randint(0, vocab, (args.micro_batch, seq), generator=g).to(device))
    return out


class Timer:
    """The suite's clock around a block: CUDA events on a GPU, ``perf_counter`` on a CPU."""

    def __init__(self, device):
        self.clock = CudaEventClock() if device.type == "cuda" else time.perf_counter

    def __enter__(self):
        self.start = self.clock()
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        self.ms = 1e3 * (self.clock() - self.start)
        return False


def step(model, opt, ids, device):
    """One training step; returns (ms on this rank, loss on this rank)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    with Timer(device) as t:
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        opt.step()
    return t.ms, out.loss.item()


def run_arms(args, arms: dict, refs: list, device, group, results, out_path):
    """Build every arm from ``refs.pop()`` (the initial model, freed once every arm is
    built), then run them round-robin; fills ``results['arms']``."""
    ep = WORLD
    ref = refs.pop()
    res = results["arms"]
    live = {}
    for name, (options, how) in arms.items():
        res[name] = {"options": options, "converted": how == "convert", "build": how,
                     "status": "ok",
                     "losses": [], "step_ms": []}
        err = None
        try:
            live[name] = make_arm(ref, options, how=how, ep=ep, group=group,
                                  optimizer=args.optimizer if device.type == "cuda"
                                  else "loop")
        except Exception as e:  # OOM is recorded, anything else raised
            if not is_oom(e):
                raise
            err = e
        if not all_ok(err is None, device):
            res[name]["status"] = f"OOM building: {err}" if err else "OOM on another rank"
            live.pop(name, None)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        say(f"built {name}: {res[name]['status']}  options {options}")
    del ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
        results["memory_after_build_gb"] = torch.cuda.memory_allocated() / 2**30
    vocab = (TINY if args.tiny else FULL)["vocab_size"]
    seq = args.seq
    total = args.warmup + args.steps
    data = batches(args, total, vocab, seq, device)
    gc.collect()
    gc.disable()  # a collection pause would land on one arm's step at random
    try:
        _run_steps(args, live, res, data, total, device, results, out_path)
        if args.profile and device.type == "cuda":
            profile_arms(args, live, data, device, results)
    finally:
        gc.enable()
    return results


def profile_arms(args, live, data, device, results):
    """``--profile N``: N more steps per arm under torch.profiler; prints (rank 0) the
    ops and kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile
    for name, (model, opt) in live.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            times = [step(model, opt, data[i % len(data)], device)[0]
                     for i in range(args.profile)]
        events = prof.key_averages()
        results.setdefault("profile", {})[name] = {"step_ms": statistics.median(times)}
        say(f"profile {name}: step {statistics.median(times):.1f} ms")
        say(events.table(sort_by="self_device_time_total", row_limit=args.profile_rows,
                         max_name_column_width=50))


def _run_steps(args, live, res, data, total, device, results, out_path):
    for i in range(total):
        for name in list(live):
            model, opt = live[name]
            err = None
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                # Every arm's weights and optimizer state stay resident: this arm's step
                # memory is the peak above what was allocated before it (its own gradients
                # released first, as the step's zero_grad would).
                opt.zero_grad(set_to_none=True)
                resident = torch.cuda.memory_allocated()
            try:
                ms, loss = step(model, opt, data[i], device)
            except Exception as e:
                if not is_oom(e):
                    raise
                err, ms, loss = e, float("nan"), float("nan")
            if not all_ok(err is None, device):
                res[name]["status"] = (f"OOM at step {i + 1}: {err}" if err
                                       else f"OOM at step {i + 1} on another rank")
                del live[name], model, opt
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                say(f"{name}: {res[name]['status']}")
                continue
            res[name]["losses"].append(reduce_mean(loss, device))
            res[name]["step_ms"].append(reduce_max(ms, device))
            if device.type == "cuda":
                peak = reduce_max((torch.cuda.max_memory_allocated() - resident) / 2**30,
                                  device)
                res[name]["step_peak_gb"] = max(res[name].get("step_peak_gb", 0.0), peak)
        if i + 1 in (1, args.warmup, total) or (i + 1) % 10 == 0:
            say(f"step {i + 1}/{total}: " + ", ".join(
                f"{n} {res[n]['step_ms'][-1]:.1f} ms loss {res[n]['losses'][-1]:.4f}"
                for n in live))
            summarise(args, results)
            write(results, out_path)
    return results


def summarise(args, results):
    arms = results["arms"]
    for r in arms.values():
        timed = r["step_ms"][args.warmup:]
        r["median_ms"] = statistics.median(timed) if timed else None
        r["timed_steps"] = len(timed)
    # The MoE-removed bound is another model: its losses are not compared.
    same = [r for r in arms.values() if r["losses"] and r.get("build") != "remove_moe"]
    first = [r["losses"][0] for r in same]
    results["step1_loss_spread"] = max(first) - min(first) if first else None
    n = min((len(r["losses"]) for r in same), default=0)
    results["loss_spread_per_step"] = [
        max(r["losses"][i] for r in same) - min(r["losses"][i] for r in same)
        for i in range(n)]
    base_arm = arms.get(results["baseline"], {})
    base = base_arm.get("median_ms")
    base_steps = base_arm.get("step_ms", [])[args.warmup:]
    for r in arms.values():
        r["speedup_vs_baseline"] = (base / r["median_ms"]
                                    if base and r.get("median_ms") else None)
        # Round-robin steps with the same index ran back to back on the same batch: the
        # median of their ratios cancels drift that the ratio of medians keeps.
        mine = r["step_ms"][args.warmup:]
        pairs = [b / a for a, b in zip(mine, base_steps) if a > 0]
        r["paired_speedup_vs_baseline"] = statistics.median(pairs) if pairs else None


def write(results, out_path):
    """The suite's format: each arm's timed steps (after warm-up) as a benchmark, the
    results beside them."""
    if RANK == 0 and out_path:
        warm = results.get("warmup", 0)
        entries = [benchmark_entry(f"e2e step · {results.get('mode')}", name,
                                   [t / 1e3 for t in r["step_ms"][warm:]],
                                   extra_info={k: r.get(k) for k in (
                                       "speedup_vs_baseline", "paired_speedup_vs_baseline")})
                   for name, r in results.get("arms", {}).items()
                   if (r.get("step_ms") or [])[warm:]]
        write_benchmark_json(out_path, entries, **results)


def plot(results, png_path):
    if RANK != 0 or not png_path:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        say(f"no plot: {e}")
        return
    arms = results["arms"]
    names = [n for n, r in arms.items() if r.get("median_ms")]
    if not names:
        return
    warm = results["warmup"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    meds = [arms[n]["median_ms"] for n in names]
    bars = ax1.bar(names, meds, color="tab:blue")
    for b, n in zip(bars, names):
        sp = arms[n].get("speedup_vs_baseline")
        ax1.annotate(f"{b.get_height():.1f}" + (f"\n{sp:.3f}x" if sp else ""),
                     (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                     va="bottom", fontsize=8)
    ax1.margins(y=0.15)
    ax1.set_ylabel("median step time (ms)")
    ax1.set_title(f"{results['mode']}: median of {results['steps']} steps")
    ax1.tick_params(axis="x", rotation=30)
    for n in names:
        ys = arms[n]["step_ms"][warm:]
        ax2.plot(range(warm + 1, warm + 1 + len(ys)), ys, marker=".", label=n)
    ax2.set_xlabel("step (after warm-up)")
    ax2.set_ylabel("step time (ms)")
    ax2.set_title("every timed step (round-robin over arms)")
    ax2.legend(fontsize=8)
    fig.suptitle(results["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    say(f"wrote {png_path}")


def out_paths(out: str | None, single: bool) -> tuple[str | None, str | None]:
    if not out:
        return None, None
    if out.endswith(".json"):
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        return out, out[:-5] + ".png"
    os.makedirs(out, exist_ok=True)
    stem = "e2e_single" if single else "e2e"
    return os.path.join(out, stem + ".json"), os.path.join(out, stem + ".png")


def environment(device) -> dict:
    import platform

    import transformers
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "world": WORLD,
           "device": (torch.cuda.get_device_name() if device.type == "cuda" else "cpu")}
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
    return env


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON path (PNG beside it) or a directory")
    ap.add_argument("--single", action="store_true",
                    help="one GPU: transformers grouped_mm vs converted (local backend)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps per arm")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per arm")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (4096; tiny 64)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--comm-num-sm", type=int, default=20)
    ap.add_argument("--comm", choices=("all_to_all", "all_to_all_symm",
                                       "deepep"),
                    default="all_to_all")
    ap.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                    help="AdamW implementation on CUDA (every arm alike)")
    ap.add_argument("--profile", type=int, default=0,
                    help="after the timed steps, profile this many steps of each arm")
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--arms", default=None, help="comma-separated subset of the arms")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a tiny model (logic check)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args(argv)
    if args.seq is None:
        args.seq = 64 if args.tiny else 4096
    return args


def main(argv=None):
    global RANK, WORLD
    args = parse_args(argv)
    distributed = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.single and distributed:
        raise SystemExit("--single runs on one process: start it without torchrun")
    if not args.single and not distributed:
        raise SystemExit("EP mode needs torchrun with --nproc_per_node >= 2 (or pass --single)")
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dtype = torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get(
            "LOCAL_WORLD_SIZE", "1"))))
    group = None
    if distributed:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        RANK, WORLD = dist.get_rank(), dist.get_world_size()
        group = dist.group.WORLD
    json_path, png_path = out_paths(args.out, args.single)
    warnings.filterwarnings("ignore", message="Setting the SM carveout")

    if args.single:
        kept = SINGLE_ON | dict(skip_recompute_combine=False, recompute_in_checkpoint=False)
        arms = {"hf_grouped_mm": ({}, "hf"), "moe_fn_local": (SINGLE_ON, "convert"),
                "moe_fn_local_kept": (kept, "convert"),
                "moe_fn_local_fp8": (SINGLE_ON | FP8, "convert"),
                "moe_removed_bound": ({}, "remove_moe")}
        baseline = "hf_grouped_mm"
    else:
        arms = {k: (v, "convert") for k, v in
                ep_arms(args.comm_num_sm, args.comm).items()}
        baseline = "off"
    if args.arms:
        keep = args.arms.split(",")
        unknown = set(keep) - set(arms)
        if unknown:
            raise SystemExit(f"unknown arms {sorted(unknown)}; arms are {list(arms)}")
        arms = {k: arms[k] for k in keep}
        baseline = baseline if baseline in arms else keep[0]
    cfg = TINY if args.tiny else FULL
    mode = (f"single {'GPU' if device.type == 'cuda' else 'CPU'}" if args.single
            else f"EP{WORLD} {args.comm}")
    results = {
        "env": environment(device), "mode": mode, "model": cfg, "seq": args.seq,
        "micro_batch": args.micro_batch, "dtype": str(dtype), "warmup": args.warmup,
        "steps": args.steps, "baseline": baseline, "round_robin": True,
        "gradient_checkpointing": "HF, use_reentrant=True",
        "optimizer": f"AdamW {args.optimizer if device.type == 'cuda' else 'loop'}",
        "dense_grad_allreduce": False, "arms": {},
        "title": (f"Qwen3-MoE-like {cfg['num_hidden_layers']}L H{cfg['hidden_size']} "
                  f"E{cfg['num_experts']} top{cfg['num_experts_per_tok']} "
                  f"I{cfg['moe_intermediate_size']}, seq {args.seq} x {args.micro_batch}/rank, "
                  f"{mode}, {dtype}, reentrant HF checkpointing, AdamW"),
    }
    say(results["title"])
    t0 = time.perf_counter()
    ref = build_reference(args, device, dtype)
    say(f"reference model built in {time.perf_counter() - t0:.1f} s: "
        f"{sum(p.numel() for p in ref.parameters()) / 1e9:.2f} B parameters")
    refs = [ref]
    del ref
    try:
        run_arms(args, arms, refs, device, group, results, json_path)
    finally:
        summarise(args, results)
        results["wall_s"] = time.perf_counter() - t0
        write(results, json_path)
    rows = [(n, r) for n, r in results["arms"].items()]
    say(f"\n{'arm':<16} {'median ms':>10} {'speedup':>8} {'paired':>7} {'step GB':>8} "
        f"{'loss step 1':>12} {'loss last':>10}  status")
    nan = float("nan")
    for n, r in rows:
        med, sp = r.get("median_ms"), r.get("speedup_vs_baseline")
        ps = r.get("paired_speedup_vs_baseline")
        say(f"{n:<16} {med if med is not None else nan:>10.2f} "
            f"{sp if sp is not None else nan:>8.3f} {ps if ps is not None else nan:>7.3f} "
            f"{r.get('step_peak_gb', 0.0):>8.2f} "
            f"{(r['losses'] or [float('nan')])[0]:>12.5f} "
            f"{(r['losses'] or [float('nan')])[-1]:>10.5f}  {r['status']}")
    say(f"step-1 loss spread across arms: {results['step1_loss_spread']}; "
        f"wall {results['wall_s']:.0f} s")
    plot(results, png_path)
    if distributed:
        dist.barrier()
        release_comm_resources()  # while NCCL lives
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
