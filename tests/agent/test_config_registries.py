"""node.toml's [registries."<host[:port]>"]: the CA bundle and credentials the agent (never a
workload) uses for a registry; a bad table, or a password file others can read, is refused with a
sentence naming the key and the fix. Every file here lives in the test's temporary folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tuneplane.agent import config
from tuneplane.agent.config_registries import registries_settings
from tuneplane.agent.image_access import RegistryAccess


def _write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_a_registry_table_gives_its_ca_and_the_password_from_a_private_file(
    tmp_path: Path,
) -> None:
    ca = _write(tmp_path / "ca.pem", "-----BEGIN CERTIFICATE-----\n", 0o644)
    secret = _write(tmp_path / "registry.password", "s3cret\nignored second line\n")
    node_toml = _write(
        tmp_path / "node.toml",
        f'[registries."registry.example:5000"]\nca_file = "{ca}"\nusername = "puller"\n'
        f'password_file = "{secret}"\n\n[registries."127.0.0.1:5001"]\n',
        0o644,
    )
    settings = config.load(node_toml)
    found = registries_settings(settings, node_toml)
    assert found == {
        "registry.example:5000": RegistryAccess(ca, "puller", "s3cret"),
        "127.0.0.1:5001": RegistryAccess(None, None, None),
    }
    # The password is never shown (repr, logs).
    assert "s3cret" not in repr(found)


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ('[registries."registry.example"]\ncafile = "/x"\n',
         "unknown key 'registries.\"registry.example\".cafile'"),
        ('[registries."registry.example"]\nca_file = "ca.pem"\n',
         "'registries.\"registry.example\".ca_file' = 'ca.pem' is not an absolute path"),
        ('[registries."registry.example"]\nusername = "puller"\n',
         "gives username without password_file; give both"),
        ('[registries."https://registry.example"]\n',
         'does not name a registry; write its host and optional port'),
        ('[registries."registry.example"]\nusername = 3\npassword_file = "/x"\n',
         "must be a string, not int"),
    ],
)  # fmt: skip
def test_a_bad_registry_table_names_the_key_and_the_fix(
    tmp_path: Path, table: str, expected: str
) -> None:
    node_toml = _write(tmp_path / "node.toml", table, 0o644)
    with pytest.raises(config.NodeConfigError) as refused:
        config.load(node_toml)
    assert expected in str(refused.value)
    assert str(node_toml) in str(refused.value)


def test_a_password_file_its_group_or_others_can_read_is_refused(tmp_path: Path) -> None:
    secret = _write(tmp_path / "registry.password", "s3cret\n", 0o640)
    node_toml = _write(
        tmp_path / "node.toml",
        f'[registries."registry.example"]\nusername = "puller"\npassword_file = "{secret}"\n',
        0o644,
    )
    settings = config.load(node_toml)  # the keys are right: only `run` reads the file
    with pytest.raises(config.NodeConfigError) as refused:
        registries_settings(settings, node_toml)
    message = str(refused.value)
    assert "can be read by its group or other users (mode 0640)" in message
    assert f"chmod 600 {secret}" in message and "s3cret" not in message
    os.chmod(secret, 0o600)
    assert registries_settings(settings, node_toml)["registry.example"].password == "s3cret"


def test_a_missing_or_empty_password_file_and_an_unreadable_ca_are_refused(
    tmp_path: Path,
) -> None:
    empty = _write(tmp_path / "empty.password", "")
    cases = {
        f'username = "u"\npassword_file = "{tmp_path / "none"}"\n': "cannot be opened",
        f'username = "u"\npassword_file = "{empty}"\n': "is empty; write the registry password",
        f'ca_file = "{tmp_path / "no-ca.pem"}"\n': "cannot be read by the agent",
    }
    for body, expected in cases.items():
        node_toml = _write(tmp_path / "node.toml", f'[registries."r.example"]\n{body}', 0o644)
        with pytest.raises(config.NodeConfigError) as refused:
            registries_settings(config.load(node_toml), node_toml)
        assert expected in str(refused.value), body
