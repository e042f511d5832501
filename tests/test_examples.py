"""The CPU examples in examples/ run as a user runs them and do what they print."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason="needs transformers")


def _run(*argv: str, timeout: int) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_train_loop_learns():
    out = _run(os.path.join(EXAMPLES, "train_loop.py"), "--steps", "120", timeout=300)
    first, last = map(float, re.search(r"held-out loss fell from (\S+) to (\S+) ", out).groups())
    assert first / last >= 10, out
    losses = [float(v) for v in re.findall(r"held-out loss (\d+\.\d+)", out)]
    assert len(losses) >= 5 and losses[-1] < losses[len(losses) // 2] < losses[0], out
    favourite = re.search(r"top-1 expert for clusters 0-7: \[([\d, ]+)\]", out)
    assert favourite and len(favourite.group(1).split(",")) == 8, out


_PARITY = (r"max \|d loss\| (\S+) \(tol (\S+)\), max \|d param\| (\S+) \(tol (\S+)\)"
           r"  MATCH")


def _check_parity(line_start: str, out: str) -> None:
    found = re.search(re.escape(line_start) + ": " + _PARITY, out)
    assert found, out
    d_loss, tol_loss, d_param, tol_param = map(float, found.groups())
    assert d_loss <= tol_loss and d_param <= tol_param, out


@needs_hf
def test_hf_convert_matches_transformers():
    out = _run(os.path.join(EXAMPLES, "hf_convert.py"), "--steps", "3", timeout=300)
    assert "converted 2 Qwen3MoeSparseMoeBlock(s)" in out, out
    assert "HF's names and shapes: True" in out, out
    assert len(re.findall(r"^\s+\d+\s+\d+\.\d+\s+\d+\.\d+$", out, re.M)) == 3, out
    _check_parity("converted vs transformers", out)


@pytest.mark.multiproc
def test_ep_torchrun_matches_one_process():
    out = _run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.join(EXAMPLES, "ep_torchrun.py"), "--steps", "3", "--device", "cpu",
               timeout=300)
    assert "rank 0: experts 0-3" in out and "rank 1: experts 4-7" in out, out
    assert "EP2 over gloo" in out, out
    # One layout and one dispatch per step: nothing is routed twice.
    for counter in ("layout", "dispatch"):
        assert re.search(rf"'{counter}': 3\b", out), out
    _check_parity("EP2 vs one process", out)


@pytest.mark.multiproc
def test_fsdp_ep_torchrun_trains_saves_and_reloads():
    out = _run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               os.path.join(EXAMPLES, "fsdp_ep_torchrun.py"), "--steps", "2", "--tokens", "16",
               "--device", "cpu", timeout=300)
    losses = re.findall(r"^step\s+\d+\s+loss (\d+\.\d+)$", out, re.M)
    assert len(losses) == 2, out
    # DP4 = 2 x EP2 under fully_shard_moe: each rank holds a quarter of every expert
    # tensor and of its Adam states.
    found = re.search(r"mesh \(2, 2\) \('dp_shard_mod_ep', 'ep'\), fully_shard_moe: expert "
                      r"params per rank (\d+) \+ Adam states (\d+) \(all experts: (\d+) \+ "
                      r"(\d+)\)", out)
    assert found, out
    mine, adam, full, full_adam = map(int, found.groups())
    assert mine * 4 == full and adam * 4 == full_adam == 2 * full, out
    assert ("DCP save and load into a fresh layer: outputs identical on every rank; after "
            "one more step of each: identical") in out, out
