"""doctor's pure checks: the GPU source, the clock skew, free disk, the control address's line,
and the runtime probe against real interpreters and files."""

from __future__ import annotations

import os
from pathlib import Path

from tuneplane.agent import doctor
from tuneplane.agent.workload_checks import Finding, interpreter_version, resolve_interpreter

GIB = 2**30
SIMULATED = {"gpu_source": "simulated", "gpus": [{"uuid": "a"}, {"uuid": "b"}]}


def test_no_running_agent_means_only_what_doctor_reads() -> None:
    found = doctor.inventory_source_finding(None, SIMULATED, "none", 0)
    assert found.level == "ok"
    assert found.text == (
        "inventory source: doctor reads none (0 GPUs); no agent is running; "
        "the last agent used simulated"
    )


def test_a_simulated_agent_is_named_beside_doctors_own_reading() -> None:
    found = doctor.inventory_source_finding(41, SIMULATED, "none", 0)
    assert found.level == "warn"
    assert "the running agent (pid 41) uses simulated (2 GPUs), not the driver" in found.text
    assert "doctor reads none (0 GPUs)" in found.text and "--simulate-gpus" in found.text


def test_the_same_source_agrees_and_a_real_disagreement_fails() -> None:
    nvml = {"gpu_source": "nvml", "gpus": [{"uuid": "a"}]}
    assert doctor.inventory_source_finding(7, nvml, "nvml", 1).level == "ok"
    failed = doctor.inventory_source_finding(7, nvml, "none", 0)
    assert failed.level == "FAIL" and "LD_LIBRARY_PATH" in failed.text


def test_clock_skew_levels_and_direction() -> None:
    now = 1_000_000
    unknown = doctor.skew_finding(None, None, now)
    assert unknown.level == "warn" and "unknown" in unknown.text
    ok = doctor.skew_finding(-300, now - 5_000, now)
    assert ok.level == "ok" and "0.3 s behind this host's" in ok.text and "5 s ago" in ok.text
    assert doctor.skew_finding(5_000, now, now).level == "warn"
    far = doctor.skew_finding(120_000, now, now)
    assert far.level == "FAIL" and "120.0 s ahead of" in far.text and "NTP" in far.text


def test_disk_thresholds_with_the_numbers() -> None:
    where = Path("/data/out")
    ok = doctor.disk_finding("output root", where, 50 * GIB, 100 * GIB)
    assert ok == Finding(
        "ok", "disk space under the output root /data/out: 50.0 GiB free of 100.0 GiB (50%)"
    )
    assert doctor.disk_finding("output root", where, 4 * GIB, 100 * GIB).level == "warn"
    assert doctor.disk_finding("output root", where, 30 * GIB, 1000 * GIB).level == "warn"
    low = doctor.disk_finding("output root", where, GIB // 2, 100 * GIB)
    assert low.level == "FAIL" and "0.5 GiB free" in low.text


def test_disk_is_measured_on_the_nearest_existing_folder(tmp_path: Path) -> None:
    found = doctor.measure_disk("work root", tmp_path / "not" / "yet")
    assert found.level in ("ok", "warn", "FAIL")
    assert f"under the work root {tmp_path / 'not' / 'yet'}: " in found.text
    assert "GiB free of" in found.text


def test_interpreters_are_resolved_with_the_runtimes_path(tmp_path: Path) -> None:
    assert resolve_interpreter("python3", "/nonexistent") is None
    script = tmp_path / "fakepy"
    script.write_text("#!/bin/sh\necho 'Fake 1.2' >&2\n")
    script.chmod(0o755)
    assert resolve_interpreter("fakepy", str(tmp_path)) == str(script)
    assert interpreter_version(str(script), "/usr/bin:/bin") == "Fake 1.2"


def test_a_hanging_or_failing_interpreter_is_a_sentence(tmp_path: Path) -> None:
    hang = tmp_path / "hang"
    hang.write_text("#!/bin/sh\nexec sleep 30\n")
    hang.chmod(0o755)
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho 'no such option' >&2\nexit 3\n")
    broken.chmod(0o755)
    for path, expected in (
        (hang, "did not answer within 0.5 s"),
        (broken, "exited with 3 (no such option)"),
    ):
        try:
            interpreter_version(str(path), "/usr/bin:/bin", limit_s=0.5)
        except RuntimeError as exc:
            assert expected in str(exc)
        else:
            raise AssertionError(f"{path} was accepted")


def test_an_unloadable_ca_or_a_bad_address_is_named(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    found = doctor.probe_coordinator("127.0.0.1:1", ca, limit_s=1)
    assert found.level == "FAIL" and f"The CA file {ca} cannot be loaded" in found.text
    found = doctor.probe_coordinator("nocolon", Path(os.devnull), limit_s=1)
    assert found.level == "FAIL" and "'nocolon' is not HOST:PORT" in found.text
