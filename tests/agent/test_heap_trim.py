"""The heap trim (agent/heap_trim.py): once per interval, never without malloc_trim."""

from __future__ import annotations

import platform

import pytest
import trio
import trio.testing

from tuneplane.agent import heap_trim


async def test_the_heap_is_trimmed_once_per_interval_and_not_before(
    mock_clock: trio.testing.MockClock,
) -> None:
    real = heap_trim.malloc_trim()
    if real is None:
        pytest.skip("this C library has no malloc_trim (glibc has)")
    calls: list[tuple[float, int]] = []

    def counted_trim(pad: int) -> int:
        # The C library's own trim, counted: the loop's timing is what is checked here.
        calls.append((trio.current_time(), pad))
        return real(pad)

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(heap_trim.trim_every, 60.0, counted_trim)
        await trio.testing.wait_all_tasks_blocked()
        assert calls == []  # nothing at start: the first trim follows the start's burst
        mock_clock.jump(59.0)
        await trio.testing.wait_all_tasks_blocked()
        assert calls == []
        mock_clock.jump(1.0)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(60.0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert calls == [(start + 60.0, 0), (start + 120.0, 0)]


async def test_without_malloc_trim_the_loop_returns_at_once() -> None:
    # A C library without malloc_trim (musl) cannot be had here: the loop is given none.
    with trio.fail_after(1):
        await heap_trim.trim_every(60.0, None)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_glibc_has_malloc_trim_and_it_answers() -> None:
    trim = heap_trim.malloc_trim()
    assert trim is not None
    assert trim(0) in (0, 1)  # 1: memory was returned, 0: there was none to return
