"""Train a small Qwen3-MoE, built from a config with random weights (no download), three
ways on the same batches from the same weights, and check that the runs agree:

  all on        converted by moe_fn.hf.convert with every optimisation on: fused
                gate+up, fused row weighting and combine, the weight-gradient overlap
                (with --ep 2) and the recompute-combine skip, under Hugging Face's
                reentrant gradient checkpointing
  all off       converted, with every option off and no checkpointing
  transformers  the unconverted model on the whole batch, in one process

With --ep 2 (the default) two processes each hold half of the experts (gloo on a CPU,
NCCL with one GPU each on CUDA) and train on their halves of each batch: the same as
training one model on the whole batch. The two converted runs do that; transformers'
model trains on the whole batch alone.

It prints the loss of every step, then the largest differences in loss and in the final
parameters between the runs, and exits with 0 when they are within tolerance (1 when
not). The batches are random tokens, so the loss stays near ln 128 = 4.85: the demo
checks that the runs agree, not that the model learns.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import os
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from .resources import leave_after_last_collective, release_comm_resources

VOCAB, SEQ = 128, 32
MODEL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=True, max_position_embeddings=2 * SEQ, tie_word_embeddings=False,
             decoder_sparse_step=1, mlp_only_layers=[])
LR = 1e-3


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(loss, parameter) tolerances for the largest absolute difference between two runs.

    float32: the runs compute the same function with float32 operations in a different
    order (fused vs separate GEMMs, fused vs reference weighting, a recompute, one process vs
    two), each op a few ulps (2^-24 relative) apart. Measured: the loss (~ln 128 = 4.85)
    differs by 0 to 5e-6 over 5-20 steps. Parameters are compared against one AdamW step
    (lr): the update ``lr * m / (sqrt(v) + eps)`` of an element whose gradient is near
    eps = 1e-8 (an expert that saw one token, an embedding row of a rare token) turns a
    rounding-level gradient difference into a visible fraction of lr; measured up to 2% of
    lr. Tolerances: 5e-5 on the loss, 10% of lr (1e-4) on parameters. A real bug (a wrong
    expert, a missed weighting, a stale route, a lost gradient) moves the first step's loss
    by >1e-3 and the parameters it touches by ~lr per step.
    bfloat16 (DeepEP): rounding is 2^-8 relative per op, and AdamW's early updates are
    +-lr per element whatever the gradient's size, so a rounding-level sign flip of a tiny
    gradient moves that element by up to 2*lr per step. The bf16 tolerances are therefore
    taken from the data (see ``bf16_tolerances``): twice the difference between the two
    runs that use none of moe_fn's options (all off and transformers), plus one bf16 step
    of the loss; these defaults apply only without the transformers run.
    """
    if dtype == torch.float32:
        return 5e-5, 0.1 * LR
    return 5e-2, 2 * LR * STEPS_FOR_BOUND


STEPS_FOR_BOUND = 5  # the demo's default step count: bounds 2*lr drift per step


def bf16_tolerances(runs) -> tuple[float, float]:
    """"At most twice the error of plain same-precision computation": the spread between
    the all-off run and transformers' own model, both bf16, is the noise floor."""
    dl = max(abs(a - b) for a, b in zip(runs["all off"][0], runs["transformers"][0]))
    dp, _ = _max_diff(runs["all off"][1], runs["transformers"][1])
    return 2 * dl + 2.0 ** -8 * 5.0, 2 * dp + LR


def build_model(seed: int, dtype: torch.dtype, device: torch.device):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(**MODEL)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen3MoeForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # Routers N(0, 1): top-2 choices well separated, so rounding never flips a route.
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "experts." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.to(device=device, dtype=dtype)


def batches(seed: int, steps: int, global_batch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000)
    return [torch.randint(0, VOCAB, (global_batch, SEQ), generator=g) for _ in range(steps)]


class _Bar:
    """tqdm on a terminal when it is installed, else one text line per step."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.enabled, self.desc, self.total, self.n = enabled, desc, total, 0
        self.bar = None
        if enabled and sys.stdout.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, leave=True, file=sys.stdout,
                                dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, loss: float) -> None:
        self.n += 1
        if not self.enabled:
            return
        line = f"  step {self.n}/{self.total}  loss {loss:.7f}"
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.5f}")
            self.bar.update(1)
            self.bar.write(line)
        else:
            width = 20
            done = width * self.n // self.total
            print(f"{self.desc} [{'#' * done}{'.' * (width - done)}]{line}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train(model, data, *, rank: int, world: int, steps: int, name: str, converted: bool,
          verbose: bool) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """``steps`` AdamW steps; returns the global loss per step, the final full state dict
    (float64 on the CPU) and the seconds taken."""
    device = next(model.parameters()).device
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    from .hf import expert_parameter_names
    experts = expert_parameter_names(model) if converted else set()
    sync = converted and world > 1
    losses = []
    bar = _Bar(steps, name, verbose)
    t0 = time.perf_counter()
    for step in range(steps):
        ids = data[step]
        if converted:  # this rank's slice of the global batch
            n = ids.shape[0] // world
            ids = ids[rank * n:(rank + 1) * n]
        ids = ids.to(device)
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        loss = out.loss.detach().float().reshape(1)
        if sync:
            for pname, p in model.named_parameters():
                if p.grad is None:
                    continue
                if pname not in experts:
                    dist.all_reduce(p.grad)
                p.grad.div_(world)
            dist.all_reduce(loss)
            loss /= world
        opt.step()
        losses.append(loss.item())
        bar.step(losses[-1])
    bar.close()
    seconds = time.perf_counter() - t0
    if converted and world > 1:
        from .hf import gather_expert_state_dict
        sd = gather_expert_state_dict(model)
    else:
        sd = model.state_dict()
    return losses, {k: v.detach().to("cpu", torch.float64) for k, v in sd.items()}, seconds


def _max_diff(a: dict, b: dict) -> tuple[float, str]:
    assert list(a) == list(b), "the two runs' state dicts differ in keys"
    worst, where = 0.0, ""
    for k in a:
        d = (a[k] - b[k]).abs().max().item() if a[k].numel() else 0.0
        if d > worst:
            worst, where = d, k
    return worst, where


def options_on(ep: int, comm: str) -> dict:
    """Every optimisation MoEConfig accepts for this exchange."""
    return dict(gate_up_impl="fused", impl="fused", overlap_weight_grad=ep > 1,
                comm_num_sm=20, skip_recompute_combine=True)


# Options that change only what runs on GPUs (the SMs the communication takes): a CPU run
# passes them but does not show them.
GPU_ONLY_OPTIONS = ("comm_num_sm",)

OPTIONS_OFF = dict(gate_up_impl="separate", impl="reference",
                   overlap_weight_grad=False, skip_recompute_combine=False)


def _say(rank, *a):
    if rank == 0:
        print(*a, flush=True)


def run(rank: int, world: int, args) -> int:
    """The demo on one rank (the process group, if any, is initialised); returns 0 on pass."""
    from .hf import convert

    # torch warns that the SM carveout (overlap_weight_grad) is experimental, once per rank.
    warnings.filterwarnings("ignore", message="Setting the SM carveout")
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.comm == "deepep" else torch.float32
    comm = args.comm if world > 1 else "local"
    group = dist.group.WORLD if world > 1 else None
    _say(rank, f"loading transformers, building the model and {args.steps} batches (seed "
               f"{args.seed})")
    ref = build_model(args.seed, dtype, device)
    data = batches(args.seed, args.steps, args.batch * world)
    n_params = sum(p.numel() for p in ref.parameters())
    _say(rank, f"model: Qwen3-MoE {MODEL['num_hidden_layers']} layers, hidden "
               f"{MODEL['hidden_size']}, {MODEL['num_experts']} experts top-"
               f"{MODEL['num_experts_per_tok']}, {n_params / 1e3:.0f}k parameters, {dtype}; "
               f"EP{world} ({comm}{' over ' + dist.get_backend() if world > 1 else ''}) on "
               f"{args.device}; {args.steps} steps of {args.batch * world}x{SEQ} tokens")

    on = options_on(world, comm)
    runs = {}
    for name, opts, ckpt in (("all on", on, True), ("all off", OPTIONS_OFF, False)):
        model = copy.deepcopy(ref)
        convert(model, process_group=group, ep_size=world,
                **({"comm_backend": comm} if world > 1 else {}), **opts)
        if ckpt:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": True})
        shown = ", ".join(f"{k}={v}" for k, v in opts.items()
                          if device.type == "cuda" or k not in GPU_ONLY_OPTIONS)
        _say(rank, f"\n[{name}] {shown}, HF gradient checkpointing "
                   f"{'on (use_reentrant=True)' if ckpt else 'off'}")
        runs[name] = train(model, data, rank=rank, world=world, steps=args.steps, name=name,
                           converted=True, verbose=rank == 0)
        _say(rank, f"[{name}] {runs[name][2]:.2f} s")
        del model

    if rank == 0 and not args.no_reference:
        _say(rank, "\n[transformers] the unconverted model on the whole global batch")
        runs["transformers"] = train(copy.deepcopy(ref), data, rank=0, world=1,
                                     steps=args.steps, name="transformers", converted=False,
                                     verbose=True)
        _say(rank, f"[transformers] {runs['transformers'][2]:.2f} s")

    ok = True
    if rank == 0:
        tol_loss, tol_param = tolerances(dtype)
        if dtype != torch.float32 and "transformers" in runs:
            tol_loss, tol_param = bf16_tolerances(runs)
        if args.tol is not None:
            tol_loss = tol_param = args.tol
        _say(rank, f"\nstep  {'all on':>12}  {'all off':>12}"
                   + (f"  {'transformers':>12}" if "transformers" in runs else ""))
        for i in range(args.steps):
            row = f"{i + 1:>4}  " + "  ".join(f"{runs[k][0][i]:>12.7f}" for k in runs)
            _say(rank, row)
        base = runs["all on"]
        for other in [k for k in runs if k != "all on"]:
            dl = max(abs(a - b) for a, b in zip(base[0], runs[other][0]))
            dp, where = _max_diff(base[1], runs[other][1])
            good = dl <= tol_loss and dp <= tol_param
            ok &= good
            _say(rank, f"all on vs {other}: max |d loss| {dl:.3e} (tol {tol_loss:.1e}), "
                       f"max |d param| {dp:.3e} (tol {tol_param:.1e}"
                       f"{', at ' + where if dp else ''})  {'OK' if good else 'FAIL'}")
        _say(rank, "PASS" if ok else "FAIL")
    return 0 if ok else 1


def _worker(rank: int, world: int, init_file: str, args, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        code = run(rank, world, args)
        dist.barrier()
    except BaseException:
        release_comm_resources()  # while their communicator lives
        dist.destroy_process_group()
        raise
    if rank == 0:
        results.put(code)  # before a gloo rank leaves at once
    leave_after_last_collective()


def check_args(args) -> None:
    if args.ep not in (1, 2):
        raise SystemExit("--ep must be 1 or 2")
    if args.steps < 1 or args.batch < 1:
        raise SystemExit("--steps and --batch must be positive")
    if args.tol is not None and not (args.tol > 0 and math.isfinite(args.tol)):
        raise SystemExit(f"--tol must be a positive finite number, got {args.tol}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
        if torch.cuda.device_count() < args.ep:
            raise SystemExit(f"--device cuda --ep {args.ep} needs {args.ep} GPUs, found "
                             f"{torch.cuda.device_count()}")
    if args.comm is not None and args.ep == 1:  # one process has no exchange to pick
        raise SystemExit(f"--comm {args.comm} needs --ep 2 (--ep 1 runs the local backend)")
    if args.comm is None:
        args.comm = "all_to_all"
    if args.comm == "deepep":
        if args.device != "cuda" or args.ep < 2:
            raise SystemExit("--comm deepep needs --device cuda and --ep 2")
        from .comm.deepep import import_deep_ep
        try:
            import_deep_ep()
        except ImportError as e:
            raise SystemExit(f"--comm deepep: {e}") from None


def demo(args) -> int:
    check_args(args)
    if importlib.util.find_spec("transformers") is None:
        raise SystemExit("the demo needs transformers: pip install 'moe-fn[hf]'")
    runs = 2 if args.no_reference else 3
    where = ("in this process" if args.ep == 1 else
             f"over {args.ep} processes ({'NCCL' if args.device == 'cuda' else 'gloo'})")
    # Said at once: starting the processes and importing transformers take seconds.
    print(f"moe_fn demo: {runs} runs of {args.steps} training steps of a small random "
          f"Qwen3-MoE on {args.device} {where}, compared step by step", flush=True)
    if args.ep == 1:
        return run(0, 1, args)
    print(f"starting {args.ep} processes (each loads torch first)", flush=True)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(args.ep, os.path.join(d, "init"), args, results),
                 nprocs=args.ep, join=True)
    return results.get()


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--steps", type=int, default=5, help="training steps per run (default 5)")
    p.add_argument("--ep", type=int, default=2, choices=(1, 2),
                   help="expert-parallel processes: 2 (default) spawns two, 1 runs the local "
                        "backend in this process")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (gloo, default) or cuda (NCCL, one GPU per process)")
    p.add_argument("--comm", choices=("all_to_all", "symm_mem", "deepep"),
                   default=None,
                   help="exchange for --ep 2 (docs/exchanges.md): all_to_all (default), "
                        "symm_mem (rows pulled from symmetric memory; on CPUs its gathering "
                        "stand-in) or deepep (CUDA, bf16; DeepEP must be importable)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and batches")
    p.add_argument("--batch", type=int, default=2,
                   help=f"sequences of {SEQ} tokens per process per step (default 2)")
    p.add_argument("--tol", type=float, default=None,
                   help="override both tolerances (largest |difference| in loss and params)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the third run, the unconverted transformers model")
    return p

