"""The README's front door: its two commands come first, its first python block (the
quickstart) runs as-is on a CPU and prints what it promises, and the figures of its opening
paragraph are what the committed measurements give."""

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from bench import tables

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BASELINE = ROOT / "bench" / "baselines" / "h200.json"
RESULTS = ROOT / "bench" / "results"
# The one-GPU end-to-end runs (the FP8 arms' and the kept activations') and the EP2 runs
# of bench/RESULTS.md's end-to-end table.
ONE_GPU = ("e2e_one_gpu.json", "e2e_one_gpu_fp8.json")
EP2 = ("e2e_ep2_all_to_all.json", "e2e_ep2_deepep.json", "e2e_ep2_symm_mem.json")


def test_the_readme_opens_with_the_demo_and_the_test_command():
    block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert block and README.index(block.group(0)) < README.index("\n## "), (
        "the README's first section must hold the two commands")
    lines = block.group(1).strip().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("python -m moe_fn demo")
    assert lines[1].endswith("python -m pytest -q -x tests")
    assert len(README.splitlines()) <= 200


def test_the_quickstart_runs_on_a_cpu_and_matches_the_reference(tmp_path):
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    assert not re.search(r"cuda", code, re.I), "the CPU quickstart names a GPU"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU, as the README promises
    # After the block as written: its input and router, for a naive routing here.
    dump = tmp_path / "routed.pt"
    tail = (f"\ntorch.save({{'x': x.detach(), 'w': layer.router.weight.detach(), "
            f"'b': layer.router.bias}}, {str(dump)!r})\n")
    run = subprocess.run([sys.executable, "-c", code + tail], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "out (4, 16, 64) router logits (64, 8)" in out
    printed = [int(c) for c in
               re.search(r"tokens per expert \[([\d, ]+)\]", out).group(1).split(",")]
    # The counts of a float64 naive top-2 of the same tokens and router weight; the second
    # and third logits of every token far enough apart that float32 picks the same two.
    saved = torch.load(dump)
    logits = saved["x"].double().reshape(-1, 64) @ saved["w"].double().t()
    if saved["b"] is not None:
        logits = logits + saved["b"].double()
    top = logits.topk(3).values
    assert (top[:, 1] - top[:, 2]).min() > 1e-4
    naive = logits.topk(2).indices.flatten().bincount(minlength=8).tolist()
    assert printed + [0] * (8 - len(printed)) == naive, (printed, naive)
    diff = float(re.search(r"float64 reference: ([\d.e+-]+)", out).group(1))
    assert diff < 1e-9, out


# ---- the opening paragraph's figures ---------------------------------------------------------

HEADLINE = re.compile(
    r"\*\*(?P<layer_ms>[\d.]+) ms: (?P<vs_transformers>[\d.]+)× transformers' `grouped_mm` block "
    r"and (?P<vs_plain>[\d.]+)× a plain PyTorch layer\*\*,\s+measured side by side "
    r"\((?P<fp8_ms>[\d.]+) ms with its FP8 experts, which run (?P<vs_torchao>[\d.]+–[\d.]+)× "
    r"faster than\s+torchao's FP8 path\); .*? trains \*\*(?P<e2e_one_gpu>[\d.]+)× faster "
    r"per\s+step\*\* than transformers' on one GPU, and (?P<e2e_ep2>[\d.]+–[\d.]+)× faster "
    r"with its options on than off\s+over two", re.S)


def _opening():
    """The README's paragraph that says what moe_fn is."""
    return next(p for p in README.split("\n\n") if p.startswith("**moe_fn**"))


def _load(name):
    return json.loads((RESULTS / name).read_text())


def _span(values, digits):
    """A range as the README writes it: ``digits`` decimals, an en dash."""
    return f"{min(values):.{digits}f}–{max(values):.{digits}f}"


def headline(data, one_gpu, ep2):
    """The opening paragraph's figures from the measurements, rounded as bench/tables.py
    renders them: the Qwen3-30B-A3B layer at 8192 tokens, forward + backward, against plain
    PyTorch and transformers (bf16) and with FP8 experts; FP8 against torchao on that
    model's expert MLP shapes, forward + backward; the best converted arm's step speedup
    over transformers on one GPU; every EP2 exchange's all-on arms (kept activations or
    not) over all off."""
    r = tables.Runs(data)
    layer = {arm: r.median_ms("test_layer", model="qwen3-30b-a3b-t8192", arm=arm,
                              phase="fwd+bwd")
             for arm in ("moe_fn", "moe_fn-fp8", "torch", "transformers")}
    torchao = []
    for model, _ in tables.FP8_EXPERTS:
        if model.startswith("qwen3-30b-a3b"):
            t = {arm: r.median_ms("test_experts", model=model, counts="uniform", arm=arm,
                                  phase="fwd+bwd") for arm in ("moe_fn-fp8", "torchao-fp8")}
            torchao.append(t["torchao-fp8"] / t["moe_fn-fp8"])
    one = [a["speedup_vs_baseline"] for run in one_gpu for a in run["arms"].values()
           if a["converted"]]
    two = [run["arms"][arm]["speedup_vs_baseline"] for run in ep2
           for arm in ("all_on", "all_on_kept")]
    return dict(layer_ms=tables._ms(layer["moe_fn"]),
                vs_transformers=tables._x(layer["moe_fn"], layer["transformers"])[:-1],
                vs_plain=tables._x(layer["moe_fn"], layer["torch"])[:-1],
                fp8_ms=tables._ms(layer["moe_fn-fp8"]), vs_torchao=_span(torchao, 1),
                e2e_one_gpu=f"{max(one):.2f}", e2e_ep2=_span(two, 2))


def _measurements():
    return (json.loads(BASELINE.read_text()), [_load(n) for n in ONE_GPU],
            [_load(n) for n in EP2])


def test_the_opening_figures_are_the_measurements():
    para = _opening()
    m = HEADLINE.search(para)
    assert m, f"the opening paragraph no longer reads as this test parses it:\n{para}"
    want = headline(*_measurements())
    wrong = {k: f"README {v}, measured {want[k]}" for k, v in m.groupdict().items()
             if v != want[k]}
    assert not wrong, wrong
    # Every time and ratio the paragraph states is one checked here.
    stated = re.findall(r"(\d[\d.–]*)(?:×| ms)", para)
    assert sorted(stated) == sorted(want.values()), stated


def test_a_changed_measurement_changes_the_opening_figures():
    data, one_gpu, ep2 = _measurements()
    want = headline(data, one_gpu, ep2)

    def slower(benchmarks, arm, test="test_layer", **params):
        for b in benchmarks:
            if (b["fullname"].split("::")[-1].split("[")[0] == test
                    and b["params"].get("arm") == arm
                    and all(b["params"].get(k) == v for k, v in params.items())):
                b["stats"]["median"] *= 1.1

    cases = {
        "layer_ms": lambda d, o, e: slower(d["benchmarks"], "moe_fn"),
        "vs_transformers": lambda d, o, e: slower(d["benchmarks"], "transformers"),
        "vs_plain": lambda d, o, e: slower(d["benchmarks"], "torch"),
        "fp8_ms": lambda d, o, e: slower(d["benchmarks"], "moe_fn-fp8",
                                         model="qwen3-30b-a3b-t8192"),
        "vs_torchao": lambda d, o, e: slower(d["benchmarks"], "torchao-fp8", "test_experts",
                                             model="qwen3-30b-a3b"),
        "e2e_one_gpu": lambda d, o, e: o[0]["arms"]["moe_fn_local_kept"].update(
            speedup_vs_baseline=1.3),
        "e2e_ep2": lambda d, o, e: e[2]["arms"]["all_on"].update(speedup_vs_baseline=1.1),
    }
    for key, change in cases.items():
        d, o, e = copy.deepcopy((data, one_gpu, ep2))
        change(d, o, e)
        got = headline(d, o, e)
        assert got[key] != want[key], key
