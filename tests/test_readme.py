"""The README's front door: its two commands come first, and its first python block (the
quickstart) runs as-is on a CPU and prints what it promises."""

import os
import re
import subprocess
import sys
from pathlib import Path

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


def test_the_quickstart_runs_on_a_cpu_and_matches_the_reference():
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    assert "cuda" not in code.split("#")[0]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU, as the README promises
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "out (4, 16, 64) router logits (64, 8)" in out
    counts = re.search(r"tokens per expert \[([\d, ]+)\]", out).group(1)
    assert sum(int(c) for c in counts.split(",")) == 4 * 16 * 2
    diff = float(re.search(r"float64 reference: ([\d.e+-]+)", out).group(1))
    assert diff < 1e-9, out
