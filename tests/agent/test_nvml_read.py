"""The NVML read, driven through the scripted NVML double (agent/scripted_nvml.py).

Every case of the review that found a failing card reported healthy: swallowed and unguarded
errors, a card lost mid-read, a whole-read failure, XIDs from a card whose UUID cannot be read,
event-wait errors, reordering, re-initialisation after a driver reload or mismatch, MIG, a hung
call under a time limit, library-not-found versus a broken driver, and pre-Ampere retired pages.
The script is a real file the real inventory code reads; nothing is patched.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tuneplane.agent.inventory import Inventory
from tuneplane.agent.inventory_source import InventorySource, probe
from tuneplane.agent.scripted_nvml import write_script

A, B, C = "GPU-aaaa", "GPU-bbbb", "GPU-cccc"


class Script:
    """The scripted NVML's file, rewritten atomically as a test changes what the GPUs say."""

    def __init__(self, path: Path, **top: Any) -> None:
        self.path = path
        self.calls = path.with_name("calls.log")
        self.top: dict[str, Any] = {"calls_log": str(self.calls), **top}
        self.cards: list[dict[str, Any]] = [{"uuid": u, "name": "NVIDIA H200"} for u in (A, B)]
        self.write()

    def card(self, uuid: str) -> dict[str, Any]:
        return next(c for c in self.cards if c["uuid"] == uuid)

    def write(self) -> None:
        write_script(self.path, {**self.top, "gpus": self.cards})

    def calls_made(self) -> list[str]:
        try:
            return [line.split()[0] for line in self.calls.read_text().splitlines()]
        except FileNotFoundError:
            return []


@pytest.fixture
def script(tmp_path: Path) -> Script:
    return Script(tmp_path / "nvml.json")


def source_for(script: Script) -> InventorySource:
    return InventorySource("node-a", None, script.path)


def health(inv: Inventory) -> dict[str, str]:
    return {g.uuid: "ok" if g.healthy else g.health_reason for g in inv.gpus}


def test_a_healthy_read_names_the_scripted_source(script: Script) -> None:
    inv = source_for(script).collect()
    assert inv.gpu_source == "scripted-nvml"
    assert health(inv) == {A: "ok", B: "ok"}
    assert [g.index for g in inv.gpus] == [0, 1]
    assert (inv.driver_version, inv.cuda_version, inv.problem) == ("550.54.15", "12.4", "")
    assert inv.xid_events == "registered on all 2 GPUs"


@pytest.mark.parametrize(
    ("function", "what"),
    [
        ("nvmlDeviceGetTotalEccErrors", "ECC counters"),
        ("nvmlDeviceGetRemappedRows", "remapped rows"),
        ("nvmlDeviceGetMigMode", "MIG mode"),
        ("nvmlDeviceGetFieldValues", "recovery action"),
        ("nvmlDeviceGetName", "name"),
        ("nvmlDeviceGetMemoryInfo", "memory size"),
        ("nvmlDeviceGetArchitecture", "architecture"),
        ("nvmlDeviceGetMinorNumber", "device minor number"),
        ("nvmlDeviceGetUUID", "UUID"),
    ],
)
@pytest.mark.parametrize(
    ("code", "words"),
    [
        ("UNKNOWN", "Unknown Error (NVML_ERROR_UNKNOWN)"),
        ("NO_PERMISSION", "Insufficient Permissions (NVML_ERROR_NO_PERMISSION)"),
        ("GPU_IS_LOST", "GPU is lost (NVML_ERROR_GPU_IS_LOST)"),
    ],
)
def test_an_error_on_one_card_marks_that_card_and_names_the_error(
    script: Script, function: str, what: str, code: str, words: str
) -> None:
    source = source_for(script)
    source.collect()  # a good read first: the card's UUID is known by its handle
    script.card(B)["errors"] = {function: code}
    script.write()
    inv = source.collect()
    assert health(inv) == {A: "ok", B: f"NVML could not read its {what}: {words}"}


def test_not_supported_means_no_data_and_nothing_else_does(script: Script) -> None:
    for key in ("ecc_uncorrected", "remapped_rows", "mig"):
        script.card(B)[key] = None
    script.card(B)["errors"] = {"nvmlDeviceGetArchitecture": "NOT_SUPPORTED"}
    script.write()
    inv = source_for(script).collect()
    assert health(inv) == {A: "ok", B: "ok"}
    assert inv.gpus[1].recovery_action == ""


def test_each_card_carries_its_device_minor_number(script: Script) -> None:
    # The driver numbers /dev/nvidia<N> in its own order; the sandbox binds by this number.
    script.card(A)["minor"] = 3
    script.card(B)["errors"] = {"nvmlDeviceGetMinorNumber": "NOT_SUPPORTED"}
    script.write()
    inv = source_for(script).collect()
    assert [(g.index, g.minor_number) for g in inv.gpus] == [(0, 3), (1, None)]
    assert health(inv) == {A: "ok", B: "ok"}


def test_gpu_is_lost_from_a_system_call_stops_nothing(script: Script) -> None:
    # Found by the Hypothesis test below: GPU_IS_LOST is about a card; from the driver-version
    # call it used to escape the read as an exception.
    script.top["errors"] = {"nvmlSystemGetDriverVersion": "GPU_IS_LOST"}
    script.write()
    inv = source_for(script).collect()
    assert health(inv) == {A: "ok", B: "ok"}
    assert inv.driver_version == ""


def test_what_the_counters_say_is_the_health(script: Script) -> None:
    script.card(A)["ecc_uncorrected"] = 3
    script.card(B)["remapped_rows"] = [0, 0, 0, 1]
    script.cards.append({"uuid": C, "remapped_rows": [0, 1, 1, 0], "recovery_action": "gpu_reset"})
    script.write()
    inv = source_for(script).collect()
    assert health(inv) == {
        A: "3 uncorrected ECC errors since the driver loaded",
        B: "row remapping failed; the card needs service",
        C: "a row remapping is pending; reset the GPU to apply it",
    }
    assert [g.recovery_action for g in inv.gpus] == ["", "", "gpu_reset"]


def test_a_card_lost_mid_read_never_hides_the_others(script: Script) -> None:
    source = source_for(script)
    source.collect()
    script.cards.append({"uuid": C})
    script.card(A)["lost"] = True
    script.write()
    inv = source.collect()
    # No handle: its UUID and name are those the read before saw at its index.
    assert health(inv) == {
        A: "NVML could not read its handle: GPU is lost (NVML_ERROR_GPU_IS_LOST)",
        B: "ok",
        C: "ok",
    }
    assert inv.gpus[0].name == "NVIDIA H200" and inv.gpus[0].memory_bytes > 0


def test_a_card_whose_handle_fails_is_reported_by_its_index(script: Script) -> None:
    source = source_for(script)
    source.collect()
    script.card(A)["errors"] = {"nvmlDeviceGetHandleByIndex": "UNKNOWN"}
    script.write()
    inv = source.collect()
    assert [(g.index, g.uuid, g.healthy) for g in inv.gpus] == [(0, A, False), (1, B, True)]
    assert inv.gpus[0].health_reason == (
        "NVML could not read its handle: Unknown Error (NVML_ERROR_UNKNOWN)"
    )


def test_a_whole_read_failure_marks_every_known_gpu_and_recovers(script: Script) -> None:
    source = source_for(script)
    assert health(source.collect()) == {A: "ok", B: "ok"}
    script.top["errors"] = {"nvmlDeviceGetCount": "UNKNOWN"}
    script.write()
    for _ in range(2):  # and again: the failure's own inventory is not taken as a good read
        inv = source.collect()
        reason = "NVML could not count the GPUs: Unknown Error (NVML_ERROR_UNKNOWN)"
        assert health(inv) == {A: reason, B: reason}
        assert inv.problem == reason
    script.top["errors"] = {}
    script.write()
    assert health(source.collect()) == {A: "ok", B: "ok"}


def test_an_xid_is_matched_by_its_handle_even_when_the_uuid_cannot_be_read(
    script: Script,
) -> None:
    source = source_for(script)
    source.collect()
    assert source.take_xid_events() == []
    script.card(B)["errors"] = {"nvmlDeviceGetUUID": "GPU_IS_LOST"}
    script.top["xids"] = [{"gpu": B, "xid": 79}]
    script.write()
    inv = source.collect()
    assert [(e.uuid, e.xid) for e in source.take_xid_events()] == [(B, 79)]
    assert source.take_xid_events() == []  # each event is handed out once
    assert not inv.gpus[1].healthy


def test_an_xid_from_a_card_gone_from_the_bus_names_no_card(script: Script) -> None:
    source = source_for(script)
    source.collect()
    script.cards = [c for c in script.cards if c["uuid"] != B]
    script.top["xids"] = [{"gpu": B, "xid": 79}]
    script.write()
    inv = source.collect()
    assert [g.uuid for g in inv.gpus] == [A]
    # The event's handle is none of this read's: uuid "" (every known GPU is disabled for it).
    assert [(e.uuid, e.xid) for e in source.take_xid_events()] == [("", 79)]


def test_reordered_cards_keep_their_uuid_and_their_xid(script: Script) -> None:
    source = source_for(script)
    source.collect()
    script.cards.reverse()
    script.top["xids"] = [{"gpu": A, "xid": 48}]
    script.write()
    inv = source.collect()
    assert [(g.index, g.uuid) for g in inv.gpus] == [(0, B), (1, A)]
    assert [(e.uuid, e.xid) for e in source.take_xid_events()] == [(A, 48)]


def test_a_wait_error_is_logged_and_the_event_set_is_made_again(
    script: Script, caplog: pytest.LogCaptureFixture
) -> None:
    source = source_for(script)
    source.collect()
    script.top["errors"] = {"nvmlEventSetWait_v2": "UNKNOWN"}
    script.write()
    with caplog.at_level(logging.ERROR, logger="tuneplane.agent.nvml_source"):
        source.collect()
    assert "gpu xid wait failed error=Unknown Error (NVML_ERROR_UNKNOWN)" in caplog.text
    assert script.calls_made().count("nvmlEventSetFree") == 1
    script.top["errors"] = {}
    script.write()
    inv = source.collect()
    assert script.calls_made().count("nvmlEventSetCreate") == 2
    assert script.calls_made().count("nvmlDeviceRegisterEvents") == 4
    assert inv.xid_events == "registered on all 2 GPUs"
    script.top["xids"] = [{"gpu": A, "xid": 94}]
    script.write()
    source.collect()
    assert [(e.uuid, e.xid) for e in source.take_xid_events()] == [(A, 94)]


def test_a_failed_event_registration_is_reported_not_hidden(script: Script) -> None:
    script.card(B)["errors"] = {"nvmlDeviceRegisterEvents": "UNKNOWN"}
    script.write()
    inv = source_for(script).collect()
    assert health(inv) == {A: "ok", B: "ok"}
    assert inv.xid_events == "registered on 1 of 2 GPUs (Unknown Error (NVML_ERROR_UNKNOWN))"


@pytest.mark.parametrize("epoch_error", ["UNINITIALIZED", "DRIVER_NOT_LOADED"])
def test_a_driver_reload_initialises_nvml_again(script: Script, epoch_error: str) -> None:
    source = source_for(script)
    source.collect()
    script.top.update(epoch=1, epoch_error=epoch_error)
    script.write()
    inv = source.collect()
    assert health(inv) == {A: "ok", B: "ok"}
    calls = script.calls_made()
    assert calls.count("nvmlInit") == 2 and calls.count("nvmlShutdown") == 1
    assert calls.count("nvmlEventSetCreate") == 2  # and the XID events registered again
    script.top["xids"] = [{"gpu": B, "xid": 79}]
    script.write()
    source.collect()
    assert [(e.uuid, e.xid) for e in source.take_xid_events()] == [(B, 79)]


def test_a_library_driver_mismatch_says_what_to_do_until_it_is_fixed(script: Script) -> None:
    source = source_for(script)
    source.collect()
    script.top.update(
        epoch=1, epoch_error="LIB_RM_VERSION_MISMATCH", init_error="LIB_RM_VERSION_MISMATCH"
    )
    script.write()
    inv = source.collect()
    assert inv.problem.startswith("NVML could not start: RM has detected an NVML/RM version")
    assert "reload the nvidia modules or reboot" in inv.problem
    assert health(inv) == {A: inv.problem, B: inv.problem}
    del script.top["init_error"]
    script.write()
    assert health(source.collect()) == {A: "ok", B: "ok"}


def test_a_mig_enabled_gpu_is_refused_and_its_mig_devices_listed(script: Script) -> None:
    script.card(B)["mig"] = {
        "current": 1,
        "devices": [
            {"uuid": "MIG-1111", "memory": 10 * 2**30, "profile": "1g.10gb"},
            {"uuid": "MIG-2222", "memory": 20 * 2**30, "profile": "2g.20gb"},
        ],
    }
    script.card(A)["mig"] = {"current": 0, "pending": 1}
    script.write()
    inv = source_for(script).collect()
    assert health(inv) == {
        A: "ok",
        B: "MIG is enabled; TunePlane assigns whole GPUs only: disable it with "
        f"`nvidia-smi -i {B} -mig 0` and reset the GPU",
    }
    mig = inv.gpus[1]
    assert mig.mig_enabled and not inv.gpus[0].mig_enabled
    assert [(d.uuid, d.memory_bytes, d.profile) for d in mig.mig_devices] == [
        ("MIG-1111", 10 * 2**30, "1g.10gb"),
        ("MIG-2222", 20 * 2**30, "2g.20gb"),
    ]


def test_library_not_found_is_zero_gpus_but_a_broken_driver_is_a_problem(script: Script) -> None:
    script.top["init_error"] = "LIBRARY_NOT_FOUND"
    script.write()
    inv = source_for(script).collect()
    assert (inv.gpus, inv.problem) == ((), "")
    assert inv.note.startswith("NVML library not found: this Node reports 0 GPUs")
    script.top["init_error"] = "DRIVER_NOT_LOADED"
    script.write()
    inv = source_for(script).collect()
    assert inv.gpus == () and inv.note == ""
    assert inv.problem == (
        "NVML could not start: Driver Not Loaded (NVML_ERROR_DRIVER_NOT_LOADED); the NVIDIA "
        "kernel driver is not loaded: load it (`modprobe nvidia`) or reinstall the driver; the "
        "agent picks the GPUs up at its next probe"
    )


def test_a_library_gone_after_gpus_were_seen_is_not_a_cpu_machine(script: Script) -> None:
    source = source_for(script)
    source.collect()
    script.top.update(epoch=1, init_error="LIBRARY_NOT_FOUND")
    script.write()
    inv = source.collect()
    assert [g.healthy for g in inv.gpus] == [False, False]
    assert "NVML_ERROR_LIBRARY_NOT_FOUND" in inv.problem


def test_pre_ampere_cards_get_the_retired_pages_check(script: Script) -> None:
    volta = {"name": "Tesla V100-SXM2-32GB", "architecture": "volta"}
    script.cards = [
        {"uuid": A, **volta, "retired_pages": {"pending": True}},
        {
            "uuid": B,
            **volta,
            "retired_pages": {"double_bit": list(range(40)), "single_bit": list(range(24))},
        },
        {"uuid": C, **volta, "retired_pages": {"double_bit": [1, 2]}},
        # An Ampere card: remapped rows, not retired pages, say how its memory is.
        {"uuid": "GPU-dddd", "architecture": "ampere", "retired_pages": {"pending": True}},
    ]
    script.write()
    inv = source_for(script).collect()
    assert health(inv) == {
        A: "a page retirement is pending; reset the GPU to apply it",
        B: "64 memory pages are retired, NVIDIA's replacement threshold; the card needs service",
        C: "ok",
        "GPU-dddd": "ok",
    }
    script.cards[2]["errors"] = {"nvmlDeviceGetRetiredPages": "UNKNOWN"}
    script.write()
    assert health(source_for(script).collect())[C] == (
        "NVML could not read its retired pages: Unknown Error (NVML_ERROR_UNKNOWN)"
    )


def test_a_hung_call_reads_unresponsive_and_never_blocks_the_caller(script: Script) -> None:
    source = source_for(script)
    source.collect()
    script.card(B)["hang"] = ["nvmlDeviceGetTotalEccErrors"]
    script.write()
    seen: list[Inventory] = []

    async def main() -> None:
        with trio.fail_after(10):
            seen.append(await probe(source, 0.5))
            # The hung read is still stuck: the next probe answers at once, no new thread.
            started = time.monotonic()
            seen.append(await probe(source, 0.5))
            assert time.monotonic() - started < 0.3

    started = time.monotonic()
    trio.run(main)  # returns although a thread is still inside NVML: shutdown is not blocked
    assert time.monotonic() - started < 5
    reason = (
        "NVML unresponsive: a read did not finish within 0.5 s (a wedged GPU or driver); the "
        "agent keeps probing"
    )
    for inv in seen:
        assert health(inv) == {A: reason, B: reason}
        assert inv.problem == reason
    del script.card(B)["hang"]
    script.write()

    async def again() -> Inventory:
        with trio.fail_after(10):
            while True:
                inv = await probe(source, 2)
                if not inv.problem:
                    return inv
                await trio.sleep(0.05)  # the abandoned read is still finishing

    assert health(trio.run(again)) == {A: "ok", B: "ok"}


def test_a_hung_read_at_start_up_does_not_hold_the_agent(script: Script) -> None:
    script.top["hang"] = ["nvmlInit"]
    script.write()
    started = time.monotonic()
    inv = source_for(script).collect_within(0.5)
    assert time.monotonic() - started < 3
    assert inv.gpus == () and inv.problem.startswith("NVML unresponsive")
    script.top["hang"] = []
    script.write()


def test_an_operator_release_lets_go_of_nvml_and_takes_it_back(script: Script) -> None:
    request = script.path.with_name("gpu-release.json")
    source = InventorySource("node-a", None, script.path, release_request=request)
    source.collect()
    until = int(time.time() * 1000) + 60_000
    write_script(request, {"until_ms": until})
    inv = source.collect()
    assert all(
        g.health_reason.startswith("NVML released for a GPU reset by the operator until ")
        for g in inv.gpus
    )
    assert inv.released_until_ms == until and len(inv.gpus) == 2
    calls = script.calls_made()
    assert calls[-2:] == ["nvmlEventSetFree", "nvmlShutdown"]
    source.collect()
    assert script.calls_made() == calls  # nothing touches NVML while it is released
    write_script(request, {"until_ms": 0})
    assert health(source.collect()) == {A: "ok", B: "ok"}
    assert script.calls_made()[len(calls) :][:2] == ["nvmlInit", "nvmlEventSetCreate"]


_FUNCTIONS = [
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceRegisterEvents",
    "nvmlDeviceGetRetiredPages",
]
_GLOBAL = ["nvmlDeviceGetCount", "nvmlEventSetCreate", "nvmlEventSetWait_v2",
           "nvmlSystemGetDriverVersion"]  # fmt: skip
_CODES = ["NOT_SUPPORTED", "UNKNOWN", "GPU_IS_LOST", "NO_PERMISSION", "UNINITIALIZED",
          "DRIVER_NOT_LOADED", "LIB_RM_VERSION_MISMATCH", "TIMEOUT", "INVALID_ARGUMENT",
          "CORRUPTED_INFOROM", "RESET_REQUIRED", "MEMORY"]  # fmt: skip
# Errors on these calls concern the card: each makes it unhealthy (the others do not:
# registration is reported in xid_events, retired pages are asked of pre-Ampere cards only).
_CARD_CALLS = set(_FUNCTIONS) - {"nvmlDeviceRegisterEvents", "nvmlDeviceGetRetiredPages"}
# Without these a card cannot be used: NOT_SUPPORTED is a failure for them too.
_NEEDED = {"nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName",
           "nvmlDeviceGetMemoryInfo"}  # fmt: skip
_PREFIXES = ("NVML could not read its ", "NVML could not count the GPUs: ",
             "NVML failed with ")  # fmt: skip


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    card_errors=st.lists(
        st.dictionaries(st.sampled_from(_FUNCTIONS), st.sampled_from(_CODES)),
        min_size=1,
        max_size=3,
    ),
    global_errors=st.dictionaries(st.sampled_from(_GLOBAL), st.sampled_from(_CODES), max_size=2),
    old_cards=st.booleans(),
)
def test_any_error_gives_a_documented_outcome_never_an_exception(
    tmp_path: Path,
    card_errors: list[dict[str, str]],
    global_errors: dict[str, str],
    old_cards: bool,
) -> None:
    path = tmp_path / "random.json"
    arch = "volta" if old_cards else "hopper"
    cards = [
        {"uuid": f"GPU-{i}", "architecture": arch, "errors": errors}
        for i, errors in enumerate(card_errors)
    ]
    write_script(path, {"gpus": cards, "errors": global_errors})
    inv = InventorySource("node-a", None, path).collect()
    if inv.problem:
        assert inv.problem.startswith(_PREFIXES)
        assert all(g.health_reason == inv.problem for g in inv.gpus)
        return
    assert [g.index for g in inv.gpus] == list(range(len(cards)))
    for gpu, errors in zip(inv.gpus, card_errors, strict=True):
        fatal = {f for f, code in errors.items() if code != "NOT_SUPPORTED" or f in _NEEDED}
        if fatal & _CARD_CALLS:
            assert not gpu.healthy
        if not gpu.healthy:
            assert gpu.health_reason.startswith(_PREFIXES)
        else:
            assert not fatal & _CARD_CALLS
