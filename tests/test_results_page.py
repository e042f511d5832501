"""bench/RESULTS.md's one-GPU tables are what the committed baseline renders."""

import json
from pathlib import Path

from bench import tables

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "bench" / "RESULTS.md"
BASELINE = ROOT / "bench" / "baselines" / "h200.json"


def test_every_table_block_is_the_baselines_rendering():
    page = PAGE.read_text()
    data = json.loads(BASELINE.read_text())
    found = tables.blocks(page)
    assert set(found) == set(tables.TABLES), (
        f"blocks on the page {sorted(found)} differ from the tables {sorted(tables.TABLES)}")
    stale = [name for name, body in found.items() if body != tables.render(name, data)]
    assert not stale, (f"{stale} disagree with {BASELINE.name}: run python -m bench.tables "
                       f"{BASELINE.relative_to(ROOT)} --write {PAGE.relative_to(ROOT)}")


def test_the_baseline_is_a_gpu_run_with_every_room():
    data = json.loads(BASELINE.read_text())
    assert "H200" in data["machine_info"]["device"]
    tests = {b["fullname"].split("::")[-1].split("[")[0] for b in data["benchmarks"]}
    rooms = {"test_activation_fwd", "test_row_weight_fwd", "test_gather_sum", "test_router",
             "test_layout", "test_grouped_linear", "test_experts", "test_layer",
             "test_checkpointed_layer", "test_host_time"}
    assert rooms <= tests, rooms - tests
    assert all(b["extra_info"] for b in data["benchmarks"])


def test_a_changed_number_is_caught():
    data = json.loads(BASELINE.read_text())
    page = tables.fill(PAGE.read_text(), data)
    for b in data["benchmarks"]:
        if b["params"].get("model") == "qwen3-30b-a3b-t8192" and b["params"].get("arm") == \
                "moe_fn" and b["params"].get("phase") == "fwd+bwd":
            b["stats"]["median"] *= 1.1
    assert tables.blocks(page)["layer"] != tables.render("layer", data)
