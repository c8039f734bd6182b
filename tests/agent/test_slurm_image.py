"""The pure parts of image runtimes on a Slurm Fleet: which runtimes are images, how the Fleet's
registries file is read (node.toml's parser), attempt.json carrying the image settings, a step
given no image root refusing with a sentence, each user's own cache under the image root (and
the refusal of one another user could have written), and the Fleet settings' checks. (End to end:
tests/integration/test_slurm_images.py.)
"""

from __future__ import annotations

import fcntl
import os
import stat
import threading
from pathlib import Path

import pytest

from tuneplane.agent.image_access import RegistryAccess
from tuneplane.agent.slurm_image import (
    LOCK_FILE,
    SlurmImageError,
    image_of,
    plan_image,
    read_registries,
    ready_image,
    user_cache,
)
from tuneplane.coordinator.executors.slurm._settings import (
    SlurmSettingsError,
    check_image_settings,
)
from tuneplane.proto.contract.slurm_attempt import AttemptFile, read_attempt_file

DIGEST = "sha256:" + "a" * 64
IMAGE = f"image:registry.example:5000/team/app@{DIGEST}"


def _attempt(image_root: str = "", registries_file: str = "") -> AttemptFile:
    return AttemptFile(
        "run-1", 1, 1, 0, "{}", {}, image_root=image_root, registries_file=registries_file
    )


def test_only_an_image_runtime_names_an_image() -> None:
    assert image_of("host:python3") is None
    found = image_of(IMAGE)
    assert found is not None and found.registry == "registry.example:5000"
    with pytest.raises(SlurmImageError, match="sha256"):
        image_of("image:registry.example:5000/team/app@sha256:short")


def test_the_registries_file_is_read_as_node_toml_reads_its_registries(tmp_path: Path) -> None:
    assert read_registries("") == {}
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    path = tmp_path / "registries.toml"
    path.write_text(f'[registries."registry.example:5000"]\nca_file = "{ca}"\n')
    assert read_registries(str(path)) == {"registry.example:5000": RegistryAccess(ca_file=ca)}

    path.write_text('[registries."registry.example:5000"]\nca_file = "ca.pem"\n')
    with pytest.raises(SlurmImageError, match="is not an absolute path"):
        read_registries(str(path))
    path.write_text('[images]\nmax_size = "1G"\n')
    with pytest.raises(SlurmImageError, match="has images, which it does not read"):
        read_registries(str(path))
    with pytest.raises(SlurmImageError, match="--registries-file"):
        read_registries(str(tmp_path / "missing.toml"))


def test_attempt_json_carries_the_fleets_image_settings(tmp_path: Path) -> None:
    written = _attempt(image_root="/var/cache/tp-images", registries_file="/etc/tp/reg.toml")
    (tmp_path / "attempt.json").write_text(written.to_json())
    assert read_attempt_file(tmp_path) == written
    (tmp_path / "attempt.json").write_text(_attempt().to_json())
    assert read_attempt_file(tmp_path).image_root == ""


def test_a_step_given_no_image_root_refuses_the_image_with_a_sentence(tmp_path: Path) -> None:
    ref = image_of(IMAGE)
    assert ref is not None
    with pytest.raises(SlurmImageError, match=r"names no image root.*--image-root"):
        plan_image(_attempt(), ref, tmp_path, tmp_path / "out", ("sh",), {}, {})


def test_an_image_root_that_cannot_be_made_is_a_sentence(tmp_path: Path) -> None:
    ref = image_of(IMAGE)
    assert ref is not None
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(SlurmImageError, match=r"image root .* cannot be used on this node"):
        ready_image(blocked / "images", {}, ref)


def test_a_step_waits_for_the_image_roots_lock_before_it_pulls(tmp_path: Path) -> None:
    """While another step holds the image root's lock, ready_image waits; once it is released,
    it pulls (here from a registry address nothing listens at, so it fails with a sentence)."""
    ref = image_of("image:127.0.0.1:9/team/app@" + DIGEST)
    assert ref is not None
    failed: list[str] = []

    def step() -> None:
        try:
            ready_image(tmp_path, {}, ref)
        except SlurmImageError as exc:
            failed.append(str(exc))

    with (tmp_path / LOCK_FILE).open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiting = threading.Thread(target=step)
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive() and not failed  # still waiting for the lock
    waiting.join(60)
    assert not waiting.is_alive()
    assert failed and "cannot be had on this node" in failed[0], failed


def test_the_fleets_image_settings_are_checked_with_sentences_naming_the_option() -> None:
    check_image_settings("", "")
    check_image_settings("/var/cache/tp-images", "/etc/tp/registries.toml")
    with pytest.raises(SlurmSettingsError, match="--image-root 'images' is not an absolute"):
        check_image_settings("images", "")
    with pytest.raises(SlurmSettingsError, match="without --image-root"):
        check_image_settings("", "/etc/tp/registries.toml")
    with pytest.raises(SlurmSettingsError, match=r"--registries-file 'reg\.toml' is not an abs"):
        check_image_settings("/var/cache/tp-images", "reg.toml")


def test_each_user_gets_a_cache_of_their_own_under_the_image_root(tmp_path: Path) -> None:
    root = tmp_path / "images"
    mine = user_cache(root, os.getuid())
    assert mine == root / f"uid-{os.getuid()}"
    found = mine.lstat()
    assert stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid()
    assert stat.S_IMODE(found.st_mode) == 0o700
    assert user_cache(root, os.getuid()) == mine  # found again as it is


def _unchanged(path: Path) -> tuple[int, int, int, list[str]]:
    st = path.lstat()
    listed = sorted(p.name for p in path.iterdir()) if stat.S_ISDIR(st.st_mode) else []
    return st.st_mode, st.st_uid, st.st_ino, listed


def test_a_cache_another_user_could_write_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    """What another user on the node could leave in a shared image root (mode 1777) before this
    user's first image job: a folder others may write, a link to their own folder, a file. Each
    is refused with a sentence, and nothing in it is touched."""
    root = tmp_path / "images"
    root.mkdir()
    root.chmod(0o1777)
    uid = os.getuid()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "roots").mkdir()
    for kind in ("a folder", "a link", "a file"):
        planted = root / f"uid-{uid}"
        if kind == "a folder":
            planted.mkdir()
            planted.chmod(0o777)
        elif kind == "a link":
            planted.symlink_to(theirs)
        else:
            planted.write_text("not a cache")
        before = _unchanged(planted)
        with pytest.raises(SlurmImageError, match=f"is {kind} owned by uid .* cannot be trusted"):
            user_cache(root, uid)
        assert _unchanged(planted) == before
        assert sorted(p.name for p in theirs.iterdir()) == ["roots"]
        if planted.is_symlink() or planted.is_file():
            planted.unlink()
        else:
            planted.rmdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="this test needs root to give a folder away")
def test_a_cache_owned_by_another_uid_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "images"
    planted = root / "uid-0"
    planted.mkdir(parents=True, mode=0o700)
    os.chown(planted, 65534, 65534)  # nobody's, not root's
    before = _unchanged(planted)
    with pytest.raises(SlurmImageError, match=r"owned by uid 65534 .* not uid 0's own folder"):
        user_cache(root, 0)
    assert _unchanged(planted) == before
