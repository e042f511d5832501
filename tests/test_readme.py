"""The README's front door: its two commands come first, and its first python block (the
quickstart) runs as-is on a CPU and prints what it promises."""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


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
