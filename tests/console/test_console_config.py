"""``[console]`` in coordinator.toml: off without it, read when right, refused with a sentence
naming the key and the fix when wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuneplane.coordinator.config import ConfigError, ConsoleSettings, parse_config

PATH = Path("/etc/tuneplane/coordinator.toml")


def test_the_console_is_off_unless_configured() -> None:
    assert parse_config("", PATH).console is None


def test_listen_and_session_lifetime_are_read() -> None:
    config = parse_config('[console]\nlisten = "[::1]:8443"\nsession_lifetime = "30m"\n', PATH)
    assert config.console == ConsoleSettings("::1", 8443, 1800)
    default = parse_config('[console]\nlisten = "0.0.0.0:0"\n', PATH).console
    assert default == ConsoleSettings("0.0.0.0", 0, 12 * 3600, 200)
    streams = parse_config('[console]\nlisten = "0.0.0.0:0"\nmax_streams = 3\n', PATH).console
    assert streams is not None and streams.max_streams == 3


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[console]\n", "[console] listen = None is not an IP address and port"),
        ('[console]\nlisten = "console.example.org:8443"\n', "is not an IP address and port"),
        ('[console]\nlisten = "127.0.0.1"\n', 'e.g. listen = "127.0.0.1:8443"'),
        ("[console]\nlisten = 8443\n", "[console] listen = 8443"),
        ('[console]\nlisten = "127.0.0.1:1"\nsession_lifetime = 5\n', "is not a duration"),
        ('[console]\nlisten = "127.0.0.1:1"\nport = 1\n', "unknown key(s) port"),
        ('console = "on"\n', "console must be a table"),
        *(
            (f'[console]\nlisten = "127.0.0.1:1"\nmax_streams = {value}\n', said)
            for value, said in (
                ("0", "max_streams = 0 is not a whole number from 1 to 10000"),
                ("-5", "max_streams = -5 is not"),
                ("10001", "max_streams = 10001 is not"),
                ('"20"', "max_streams = '20' is not"),
                ("2.5", "max_streams = 2.5 is not"),
                ("true", "max_streams = True is not"),
            )
        ),
    ],
)
def test_a_wrong_console_table_is_refused_with_the_fix(text: str, said: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(text, PATH)
    assert str(PATH) in str(refused.value)
    assert said in str(refused.value)
