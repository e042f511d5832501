"""bench/RESULTS.md's one-GPU tables, rendered from a pytest-benchmark JSON.

``python -m bench.tables bench/baselines/h200.json`` prints every table; ``--write
bench/RESULTS.md`` replaces the blocks between ``<!-- table: NAME -->`` and
``<!-- end table -->`` in place; ``--plot docs/layer.png`` draws the README's figure (needs
matplotlib). ``tests/test_results_page.py`` checks that the page's blocks
are what the committed baseline renders, so the page cannot drift from its data.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable

KERNEL_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")
LAYER_ROWS = ("qwen3-30b-a3b-t2048", "qwen3-30b-a3b-t4096", "qwen3-30b-a3b-t8192",
              "qwen3-30b-a3b-t16384", "mixtral-8x7b", "deepseek-v3-32e")


class Runs:
    """The benchmarks of one JSON, looked up by test function and params."""

    def __init__(self, data: dict):
        self.data = data
        self.rows = data["benchmarks"]

    def find(self, test: str, **params):
        for b in self.rows:
            if b["fullname"].split("::")[-1].split("[")[0] != test:
                continue
            if all(b["params"].get(k) == v for k, v in params.items()):
                return b
        return None

    def median_ms(self, test: str, **params) -> float | None:
        b = self.find(test, **params)
        return None if b is None else b["stats"]["median"] * 1e3

    def info(self, test: str, key: str, **params):
        b = self.find(test, **params)
        return None if b is None else b["extra_info"].get(key)


def _ms(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.3f}" if v < 1 else f"{v:.2f}"


def _x(a: float | None, b: float | None) -> str:
    """How many times faster ``a`` (a time) is than ``b``."""
    return "—" if a is None or b is None else f"{b / a:.2f}×"


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def _header(*cols) -> list[str]:
    return [_row(cols), _row("---" for _ in cols)]


def layer(r: Runs) -> list[str]:
    out = _header("layer, tokens", "phase", "moe_fn (TFLOP/s)", "moe_fn, `impl=\"reference\"`",
                  "plain PyTorch", "transformers `grouped_mm`", "vs plain",
                  "vs transformers")
    for model in LAYER_ROWS:
        for phase in ("fwd", "fwd+bwd"):
            t = {arm: r.median_ms("test_layer", model=model, arm=arm, phase=phase)
                 for arm in ("moe_fn", "moe_fn-reference", "torch", "transformers")}
            if t["moe_fn"] is None:
                continue
            tf = r.info("test_layer", "tflops", model=model, arm="moe_fn", phase=phase)
            name = model.replace("qwen3-30b-a3b-t", "Qwen3-30B-A3B, ").replace(
                "mixtral-8x7b", "Mixtral-8x7B, 8192").replace(
                "deepseek-v3-32e", "DeepSeek-V3 (32 experts), 8192")
            out.append(_row([name if phase == "fwd" else "", phase,
                             f"**{_ms(t['moe_fn'])}** ({tf:.0f})", _ms(t["moe_fn-reference"]),
                             _ms(t["torch"]), _ms(t["transformers"]),
                             _x(t["moe_fn"], t["torch"]), _x(t["moe_fn"], t["transformers"])]))
    return out


def layer_queued(r: Runs) -> list[str]:
    model = "qwen3-30b-a3b-t8192"
    out = _header("arm", "8 forwards queued", "per forward", "TFLOP/s")
    names = {"moe_fn": "moe_fn", "moe_fn-reference": "moe_fn, `impl=\"reference\"`",
             "torch": "plain PyTorch", "transformers": "transformers `grouped_mm`"}
    for arm, name in names.items():
        b = r.find("test_layer_pipelined", model=model, arm=arm)
        if b is None:
            continue
        out.append(_row([name, _ms(b["stats"]["median"] * 1e3) + " ms",
                         _ms(b["extra_info"]["per_forward_ms"]) + " ms",
                         f"{b['extra_info']['tflops']:.0f}"]))
    for phase in ("fwd", "fwd+bwd"):
        ratio = r.info("test_layer_default_against_reference", "paired_ratio", model=model,
                       phase=phase)
        if ratio is not None:
            out.append(_row([f"paired, default / `impl=\"reference\"`, {phase}", "", "",
                             f"**{ratio:.3f}**"]))
    return out


def experts(r: Runs) -> list[str]:
    out = _header("model, counts", "phase", "moe_fn fused gate+up (TFLOP/s)",
                  "moe_fn separate", "plain PyTorch", "transformers `grouped_mm`",
                  "vs plain", "vs transformers")
    names = {"qwen3-30b-a3b": "Qwen3-30B-A3B", "mixtral-8x7b": "Mixtral-8x7B",
             "deepseek-v3": "DeepSeek-V3"}
    for model in KERNEL_MODELS:
        for counts in ("uniform", "skewed"):
            for phase in ("fwd", "fwd+bwd"):
                t = {arm: r.median_ms("test_experts", model=model, counts=counts, arm=arm,
                                      phase=phase)
                     for arm in ("moe_fn", "moe_fn-separate", "torch", "transformers")}
                if t["moe_fn"] is None:
                    continue
                tf = r.info("test_experts", "tflops", model=model, counts=counts,
                            arm="moe_fn", phase=phase)
                out.append(_row([f"{names[model]}, {counts}" if phase == "fwd" else "",
                                 phase, f"**{_ms(t['moe_fn'])}** ({tf:.0f})",
                                 _ms(t["moe_fn-separate"]), _ms(t["torch"]),
                                 _ms(t["transformers"]), _x(t["moe_fn"], t["torch"]),
                                 _x(t["moe_fn"], t["transformers"])]))
    return out


# (label, test, extra params) of the kernel benchmarks, moe_fn against plain PyTorch.
KERNELS = (
    ("activation fwd, swiglu halves", "test_activation_fwd", dict(act="swiglu-halves")),
    ("activation bwd, swiglu halves", "test_activation_bwd", dict(act="swiglu-halves")),
    ("activation fwd, swiglu_oai interleaved", "test_activation_fwd",
     dict(act="swiglu_oai-interleaved")),
    ("activation bwd, swiglu_oai interleaved", "test_activation_bwd",
     dict(act="swiglu_oai-interleaved")),
    ("row weighting fwd", "test_row_weight_fwd", {}),
    ("row weighting bwd", "test_row_weight_bwd", {}),
    ("combine gather-sum", "test_gather_sum", dict(weighted=False)),
    ("combine gather-sum, weighted", "test_gather_sum", dict(weighted=True)),
    ("combine weighted bwd", "test_weighted_gather_sum_bwd", {}),
    ("router (scores, top-k)", "test_router", {}),
    ("router linear + top-k", "test_router_linear", {}),
    ("dispatch layout", "test_layout", {}),
    ("dispatch gather", "test_gather_rows", {}),
    ("grouped linear fwd", "test_grouped_linear", dict(phase="fwd")),
    ("grouped linear fwd+bwd", "test_grouped_linear", dict(phase="fwd+bwd")),
)


def kernels(r: Runs) -> list[str]:
    out = _header("op", *(f"{m}: moe_fn µs, vs plain (of ceiling)" for m in KERNEL_MODELS))
    for label, test, params in KERNELS:
        cells = [label]
        for model in KERNEL_MODELS:
            mine = r.find(test, model=model, arm="moe_fn", **params)
            ref = r.median_ms(test, model=model, arm="torch", **params)
            if mine is None:
                cells.append("—")
                continue
            t = mine["stats"]["median"] * 1e3
            of = mine["extra_info"].get("of_ceiling")
            share = f" ({of:.0%})" if of is not None and of >= 0.1 else ""
            cells.append(f"{t * 1e3:,.0f}, {_x(t, ref)}{share}")
        out.append(_row(cells))
    return out


def checkpoint(r: Runs) -> list[str]:
    out = _header("arm", "fwd+bwd", "vs `torch.utils.checkpoint`")
    names = {"unchecked": "not checkpointed", "torch": "`torch.utils.checkpoint`",
             "moe_fn": "`moe_fn.checkpoint` (routing replay)",
             "moe_fn-skip": "`moe_fn.checkpoint` + `skip_recompute_combine`"}
    base = r.median_ms("test_checkpointed_layer", model="qwen3-30b-a3b", arm="torch")
    for arm, name in names.items():
        t = r.median_ms("test_checkpointed_layer", model="qwen3-30b-a3b", arm=arm)
        if t is not None:
            out.append(_row([name, f"{_ms(t)} ms", _x(t, base)]))
    return out


def launch(r: Runs) -> list[str]:
    out = _header("call", "Triton's launch path", "moe_fn's launch", "saved")
    cases = ("gather_sum", "activation", "router", "dispatch layout", "layer fwd",
             "layer fwd+bwd")
    for case in cases:
        fast = r.median_ms("test_host_time", case=case, arm="moe_fn")
        slow = r.median_ms("test_host_time", case=case, arm="triton")
        if fast is None or slow is None:
            continue
        out.append(_row([case, f"{slow * 1e3:,.0f} µs", f"{fast * 1e3:,.0f} µs",
                         f"{(slow - fast) * 1e3:,.0f} µs"]))
    add = r.median_ms("test_host_time", case="torch.add", arm="torch")
    if add is not None:
        out.append(_row(["`torch.add` (one plain launch)", "", f"{add * 1e3:,.0f} µs", ""]))
    return out


# The expert MLP shapes of the FP8 table: one EP8 rank's rows (as in the experts table) and
# the one-GPU layer's 128 experts.
FP8_EXPERTS = (("qwen3-30b-a3b", "Qwen3-30B-A3B, 131,072 rows / 16 experts"),
               ("qwen3-30b-a3b-e128", "Qwen3-30B-A3B, 65,536 rows / 128 experts"),
               ("mixtral-8x7b", "Mixtral-8x7B, 16,384 / 8"),
               ("deepseek-v3", "DeepSeek-V3, 65,536 / 32"))


def fp8(r: Runs) -> list[str]:
    out = _header("", "phase", "bf16 (moe_fn default)", "**FP8** (bf16-equivalent TFLOP/s)",
                  "torchao FP8 rowwise", "transformers `grouped_mm`", "FP8 vs bf16",
                  "FP8 vs torchao", "FP8 vs transformers")
    rows = [(f"expert MLP: {label}", "test_experts", dict(model=m, counts="uniform"))
            for m, label in FP8_EXPERTS]
    rows += [(f"layer: Qwen3-30B-A3B, {m.split('-t')[-1]} tokens", "test_layer", dict(model=m))
             for m in LAYER_ROWS if m.startswith("qwen3")]
    for label, test, params in rows:
        for phase in ("fwd", "fwd+bwd"):
            t = {arm: r.median_ms(test, arm=arm, phase=phase, **params)
                 for arm in ("moe_fn", "moe_fn-fp8", "torchao-fp8", "transformers")}
            if t["moe_fn"] is None or t["moe_fn-fp8"] is None:
                continue
            tf = r.info(test, "tflops", arm="moe_fn-fp8", phase=phase, **params)
            out.append(_row([label if phase == "fwd" else "", phase, _ms(t["moe_fn"]),
                             f"**{_ms(t['moe_fn-fp8'])}** ({tf:.0f})", _ms(t["torchao-fp8"]),
                             _ms(t["transformers"]), _x(t["moe_fn-fp8"], t["moe_fn"]),
                             _x(t["moe_fn-fp8"], t["torchao-fp8"]),
                             _x(t["moe_fn-fp8"], t["transformers"])]))
    for phase in ("fwd", "fwd+bwd"):
        ratio = r.info("test_layer_fp8_against_default", "paired_ratio",
                       model="qwen3-30b-a3b-t8192", phase=phase)
        if ratio is not None:
            out.append(_row([f"layer, 8192 tokens, paired FP8 / bf16, {phase}", "", "", "",
                             "", "", f"**{1 / ratio:.3f}×**", "", ""]))
    return out


def provenance(r: Runs) -> list[str]:
    m = r.data["machine_info"]
    first = r.rows[0]["extra_info"] if r.rows else {}
    ceilings = (f"bf16 matmul ceiling {first.get('ceiling_tflops', 0):.0f} TFLOP/s"
                if "ceiling_tflops" in first else "")
    for b in r.rows:
        if "ceiling_tflops" in b["extra_info"]:
            ceilings = f"bf16 matmul ceiling {b['extra_info']['ceiling_tflops']:.0f} TFLOP/s"
            break
    for b in r.rows:
        if "ceiling_gbs" in b["extra_info"]:
            ceilings += f", device copy {b['extra_info']['ceiling_gbs'] / 1e3:.2f} TB/s"
            break
    rounds = sorted({b["stats"]["rounds"] for b in r.rows})
    return [f"{m.get('device')}; torch {m.get('torch')}, triton {m.get('triton')}, "
            f"transformers {m.get('transformers')}, CUDA {m.get('cuda')}, Python "
            f"{m.get('python')}; {r.data['datetime'][:16].replace('T', ' ')} UTC; "
            f"{'/'.join(map(str, rounds))} timed rounds per benchmark; {ceilings} "
            f"(measured in the same run)."]


TABLES: dict[str, Callable[[Runs], list[str]]] = {
    "provenance": provenance, "layer": layer, "layer-queued": layer_queued,
    "experts": experts, "fp8": fp8, "kernels": kernels, "checkpoint": checkpoint,
    "launch": launch,
}
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end table -->)",
                   re.S)


def render(name: str, data: dict) -> str:
    return "\n".join(TABLES[name](Runs(data))) + "\n"


def blocks(page: str) -> dict[str, str]:
    """The page's table blocks, by name."""
    return {m["name"]: m["body"] for m in BLOCK.finditer(page)}


def fill(page: str, data: dict) -> str:
    """``page`` with every table block replaced by its rendering of ``data``."""
    def sub(m):
        return m.group(1) + render(m["name"], data) + m.group(4)
    return BLOCK.sub(sub, page)


def plot_layer(data: dict, path: str) -> None:
    """The Qwen3-30B-A3B layer's forward + backward TFLOP/s per token count and arm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = Runs(data)
    models = [m for m in LAYER_ROWS if m.startswith("qwen3")]
    arms = {"moe_fn": "moe_fn", "torch": "plain PyTorch",
            "transformers": "transformers grouped_mm"}
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=120)
    width = 0.8 / len(arms)
    for j, (arm, label) in enumerate(arms.items()):
        ys = [r.info("test_layer", "tflops", model=m, arm=arm, phase="fwd+bwd") or 0
              for m in models]
        xs = [i + (j - 1) * width for i in range(len(models))]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ceiling = next((b["extra_info"]["ceiling_tflops"] for b in r.rows
                    if "ceiling_tflops" in b["extra_info"]), None)
    if ceiling:
        ax.axhline(ceiling, color="grey", lw=0.8, ls="--")
        ax.set_ylim(0, ceiling * 1.25)
        ax.text(len(models) - 0.5, ceiling, f"bf16 matmul ceiling {ceiling:.0f}", ha="right",
                va="bottom", fontsize=7, color="grey")
    ax.set_xticks(range(len(models)), [m.split("-t")[-1] + " tokens" for m in models])
    ax.set_ylabel("TFLOP/s (forward + backward)")
    m = data["machine_info"]
    ax.set_title(f"Qwen3-30B-A3B MoE layer, bf16, one {m.get('device', 'GPU')}; "
                 f"torch {m.get('torch', '')}", fontsize=9)
    ax.legend(fontsize=8, frameon=False, loc="upper left", ncols=3)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="a pytest-benchmark JSON (--benchmark-json)")
    p.add_argument("--write", metavar="PAGE", help="fill PAGE's table blocks in place")
    p.add_argument("--plot", metavar="PNG", help="draw the layer figure")
    args = p.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    if args.plot:
        plot_layer(data, args.plot)
        return
    if args.write:
        with open(args.write) as f:
            page = f.read()
        with open(args.write, "w") as f:
            f.write(fill(page, data))
        return
    for name in TABLES:
        print(f"<!-- table: {name} -->\n{render(name, data)}")


if __name__ == "__main__":
    main()
