"""Inventory from the explicit simulated source and from an NVML that is not there."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuneplane.agent.inventory import (
    InventoryError,
    SimulatedGpus,
    parse_simulate_gpus,
    series_of,
)
from tuneplane.agent.inventory_source import InventorySource
from tuneplane.agent.scripted_nvml import write_script


def test_simulated_gpus_are_named_as_such() -> None:
    inv = InventorySource("node-a", parse_simulate_gpus("h200:2")).collect()
    assert inv.gpu_source == "simulated"
    assert [g.uuid for g in inv.gpus] == ["GPU-sim-node-a-0", "GPU-sim-node-a-1"]
    assert all(g.series == "h200" and g.healthy for g in inv.gpus)
    assert inv.hostname == "node-a" and inv.cpu_count >= 1 and inv.memory_bytes > 0
    assert inv.gpu(1) is not None and inv.gpu(2) is None


@pytest.mark.parametrize("text", ["h200", "h200:", "h200:x", ":2", "h200:0", "H 200:2", "h200:65"])
def test_bad_simulate_gpus_is_a_clear_error(text: str) -> None:
    with pytest.raises(InventoryError, match="--simulate-gpus h200:2"):
        parse_simulate_gpus(text)


def test_simulate_gpus_reads_series_and_count() -> None:
    assert parse_simulate_gpus("H100:8") == SimulatedGpus("h100", 8)


def test_without_nvml_there_are_zero_gpus_never_fake_ones(tmp_path: Path) -> None:
    # NVML's library is not on the machine (scripted, so the test means the same on a GPU host).
    script = tmp_path / "nvml.json"
    write_script(script, {"init_error": "LIBRARY_NOT_FOUND", "gpus": [{"uuid": "GPU-a"}]})
    inv = InventorySource("node-a", None, script).collect()
    assert inv.gpu_source == "scripted-nvml"
    assert inv.gpus == ()
    assert inv.problem == ""
    assert inv.note.startswith("NVML library not found: this Node reports 0 GPUs")


@pytest.mark.parametrize(
    ("name", "series"),
    [("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"), ("Tesla V100-PCIE-16GB", "v100")],
)
def test_series_from_product_name(name: str, series: str) -> None:
    assert series_of(name) == series
