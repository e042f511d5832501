"""What the demo tells its user: plain help text, what it does before it does it, and no
GPU-only options on a CPU run."""

from __future__ import annotations

import pytest

from moe_fn.__main__ import main


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out
    assert "see tolerances" not in out.replace("`", "")  # an internal function's name
    assert "all on" in out and "all off" in out and "transformers" in out


def test_cpu_run_says_what_it_does_first(capsys):
    assert main(["demo", "--ep", "1", "--steps", "2", "--no-reference"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("moe_fn demo: 2 runs of 2 training steps"), lines[:3]
    assert lines[1].startswith("loading transformers"), lines[:3]
    assert sum("step 1/2" in line for line in lines) == 2  # progress per step, per run
    assert not any("comm_num_sm" in line for line in lines), lines
