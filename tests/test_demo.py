"""``python -m moe_fn demo``: the CLI parses, and the optimised and plain runs agree."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from moe_fn import demo
from moe_fn.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIFF = re.compile(r"all on vs (.+?): max \|d loss\| (\S+) \(tol (\S+)\), max \|d param\| (\S+) "
                  r"\(tol (\S+?)[,)]")


def _check_diffs(out: str, expected: int) -> None:
    found = DIFF.findall(out)
    assert len(found) == expected, out
    for other, dl, tl, dp, tp in found:
        assert float(dl) <= float(tl) and float(dp) <= float(tp), (other, out)


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "demo" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--steps", "--ep", "--device", "--comm", "--seed"):
        assert flag in out
    assert main([]) == 2  # no command: help, non-zero


def test_bad_arguments():
    with pytest.raises(SystemExit):
        main(["demo", "--ep", "3"])
    with pytest.raises(SystemExit, match="deepep"):
        main(["demo", "--comm", "deepep"])  # needs CUDA
    # One process runs the local backend: an exchange asked for is refused, not ignored.
    with pytest.raises(SystemExit, match="--comm symm_mem needs --ep 2"):
        main(["demo", "--ep", "1", "--comm", "symm_mem"])
    for tol in ("nan", "-1", "0"):  # refused up front, not after the whole run
        with pytest.raises(SystemExit, match="--tol must be a positive finite number"):
            main(["demo", "--tol", tol])


def test_demo_single_process(capsys, monkeypatch):
    assert main(["demo", "--ep", "1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out
    _check_diffs(out, 2)
    # The exit code follows the comparison: nothing passes a negative tolerance.
    monkeypatch.setattr(demo, "tolerances", lambda dtype: (-1.0, -1.0))
    assert main(["demo", "--ep", "1", "--steps", "1", "--no-reference"]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.multiproc
@pytest.mark.parametrize("comm", ["all_to_all", "symm_mem"])
def test_demo_expert_parallel_gloo(comm):
    proc = subprocess.run([sys.executable, "-m", "moe_fn", "demo", "--steps", "2", "--comm",
                           comm], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"EP2 ({comm} over gloo)" in proc.stdout
    assert "overlap_weight_grad=True" in proc.stdout and "use_reentrant=True" in proc.stdout
    _check_diffs(proc.stdout, 2)
    assert proc.stdout.rstrip().endswith("PASS")
