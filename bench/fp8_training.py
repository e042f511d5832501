"""FP8 against bf16 training: the same model, weights and batches, every step's loss.

    python bench/fp8_training.py --model demo --steps 300 --out $OUT/fp8_demo.json
    python bench/fp8_training.py --model e2e --steps 200 --out $OUT/fp8_e2e.json
    python bench/fp8_training.py --model demo --steps 20 --device cpu   # the logic

Models (transformers' Qwen3-MoE from a config, random weights, converted by moe_fn.hf.convert
with every one-GPU option on): ``demo`` is ``python -m moe_fn demo``'s (2 layers, H 64, 8
experts top-2, vocabulary 128, sequences of 32, batch 16); ``e2e`` is bench/gpu_e2e.py's
(4 layers, H 2048, 128 experts top-8 of 768, vocabulary 32000, sequences of 1024, batch 2).
Two arms, ``expert_precision`` 'native' and 'fp8_rowwise', AdamW, HF reentrant gradient
checkpointing, bf16 on CUDA (float32 on the CPU). The batches follow a fixed random Markov
chain (each token has four likely successors), so the loss falls from ln V towards ln 4 and
a numerical problem shows in the curve. The FP8 arm runs under
``moe_fn.set_debug_checks(True)``: an inf or NaN reaching its quantisation raises.

Pass: every step's FP8 loss after ``--warmup-steps`` within ``--tol`` (1%) of bf16's, and
every loss finite. Writes the losses (JSON) and their plot (PNG beside it).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import moe_fn
from bench.gpu_e2e import FULL, environment
from moe_fn.demo import MODEL as DEMO
from moe_fn.hf import convert

MODELS = {"demo": (DEMO, 32, 16, 1e-3), "e2e": (FULL, 1024, 2, 3e-4)}
ARMS = {"bf16": "native", "fp8": "fp8_rowwise"}


def markov_batches(steps: int, batch: int, seq: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    out = []
    for _ in range(steps):
        t = torch.empty(batch, seq, dtype=torch.long)
        t[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for i in range(1, seq):
            pick = torch.multinomial(probs, batch, replacement=True, generator=g)
            t[:, i] = succ[t[:, i - 1], pick]
        out.append(t)
    return out


def build(cfg_dict, device, dtype, seed):
    import transformers

    cfg = transformers.Qwen3MoeConfig(**cfg_dict)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(cfg)
    return model.to(dtype)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="demo")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup-steps", type=int, default=20,
                    help="steps before the loss comparison starts")
    ap.add_argument("--tol", type=float, default=0.01)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default=None, help="JSON path (PNG beside it)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg, seq, batch, lr = MODELS[args.model]
    data = markov_batches(args.steps, batch, seq, cfg["vocab_size"], args.seed + 1)
    ref = build(cfg, device, dtype, args.seed)
    arms = {}
    for name, precision in ARMS.items():
        model = copy.deepcopy(ref)
        convert(model, gate_up_impl="fused", impl="fused", skip_recompute_combine=True,
                expert_precision=precision)
        model.train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": True})
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01,
                                **({"fused": True} if device.type == "cuda" else {}))
        arms[name] = (model, opt, [])
    del ref
    t0 = time.perf_counter()
    for i, ids in enumerate(data):
        ids = ids.to(device)
        for name, (model, opt, losses) in arms.items():
            moe_fn.set_debug_checks(name == "fp8")
            try:
                opt.zero_grad(set_to_none=True)
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                opt.step()
            finally:
                moe_fn.set_debug_checks(False)
            losses.append(loss.item())
        if (i + 1) % args.log_every == 0 or i == 0:
            print(f"step {i + 1}: " + ", ".join(f"{n} {a[2][-1]:.4f}" for n, a in arms.items()),
                  flush=True)
    wall = time.perf_counter() - t0
    bf, f8 = arms["bf16"][2], arms["fp8"][2]
    rel = [abs(a - b) / abs(b) for a, b in zip(f8, bf)]
    after = rel[args.warmup_steps:]
    finite = all(math.isfinite(v) for v in bf + f8)
    ok = finite and bool(after) and max(after) <= args.tol
    result = dict(env=environment(device), model=args.model, config=cfg, seq=seq, batch=batch,
                  lr=lr, dtype=str(dtype), steps=args.steps, warmup_steps=args.warmup_steps,
                  tol=args.tol, losses={"bf16": bf, "fp8": f8},
                  max_rel_diff_after_warmup=max(after) if after else None,
                  mean_rel_diff_after_warmup=sum(after) / len(after) if after else None,
                  all_finite=finite, passed=ok, wall_s=wall)
    worst, mean = result["max_rel_diff_after_warmup"], result["mean_rel_diff_after_warmup"]
    print(f"max |fp8 - bf16| / bf16 after step {args.warmup_steps}: {worst:.4%} (mean "
          f"{mean:.4%}); finite {finite}; {'PASS' if ok else 'FAIL'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        _plot(result, os.path.splitext(args.out)[0] + ".png")
    return 0 if ok else 1


def _plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                               gridspec_kw={"height_ratios": [3, 1]})
    steps = range(1, len(result["losses"]["bf16"]) + 1)
    for name, losses in result["losses"].items():
        a.plot(steps, losses, label=name, lw=1)
    a.set_ylabel("loss")
    a.legend()
    device = result["env"].get("device", "")
    a.set_title(f"{result['model']} model: FP8 experts against bf16 ({device})")
    rel = [100 * (x - y) / y for x, y in zip(result["losses"]["fp8"], result["losses"]["bf16"])]
    b.plot(steps, rel, lw=1, color="C2")
    b.axhline(100 * result["tol"], ls=":", color="grey")
    b.axhline(-100 * result["tol"], ls=":", color="grey")
    b.set_ylabel("fp8 - bf16 (%)")
    b.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
