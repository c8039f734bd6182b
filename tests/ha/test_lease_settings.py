"""``[leader]`` in coordinator.toml: the lease's timings, and what a wrong one is told (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuneplane.coordinator.config import ConfigError, parse_config
from tuneplane.coordinator.leadership import LeaseSettings, must_step_down_at

PATH = Path("/etc/tp/coordinator.toml")


def test_without_a_leader_table_the_defaults_hold() -> None:
    settings = parse_config("", PATH).leader
    assert (settings.ttl_s, settings.renew_s, settings.poll_s) == (10.0, 1.0, 0.5)


def test_a_leader_table_sets_the_timings() -> None:
    text = "[leader]\nttl_s = 4\nrenew_s = 0.5\npoll_s = 0.25\n"
    assert parse_config(text, PATH).leader == LeaseSettings(4.0, 0.5, 0.25)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[leader]\nttl_s = 2\nrenew_s = 1.5\n", "renew_s (1.5) must be at most half of ttl_s"),
        ("[leader]\npoll_s = 0\n", "poll_s must be a positive number of seconds"),
        ('[leader]\nttl_s = "5s"\n', "[leader] ttl_s = '5s' must be a number of seconds"),
        ("[leader]\nttl_s = true\n", "must be a number of seconds"),
        ("[leader]\nlease = 5\n", "lease"),
        ("leader = 5\n", "leader must be a table"),
    ],
)
def test_a_wrong_leader_table_is_refused_naming_the_file_and_the_key(text: str, said: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(text, PATH)
    assert str(PATH) in str(refused.value) and said in str(refused.value)


@given(
    ttl=st.floats(min_value=0.1, max_value=600),
    share=st.floats(min_value=0.01, max_value=0.5),
    started=st.floats(min_value=0, max_value=1e6),
)
def test_a_leader_that_cannot_renew_steps_down_before_its_lease_can_expire(
    ttl: float, share: float, started: float
) -> None:
    settings = LeaseSettings(ttl_s=ttl, renew_s=ttl * share, poll_s=0.5)
    down = must_step_down_at(started, settings)
    # Before the lease's end (counted from when the renewal started, no later than the
    # database's own start of it), and after the next renewal is due.
    assert down < started + ttl
    assert down >= started + settings.renew_s - 1e-9
