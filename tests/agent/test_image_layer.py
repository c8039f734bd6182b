"""OCI layers applied to real directories: files, links, modes and whiteouts as the image spec
says; hostile layers (``..``, links out of the root, writes through links, device nodes) refused
or skipped with nothing written outside the root, checked against a real directory beside it."""

from __future__ import annotations

import gzip
import io
import os
import re
import stat
import tarfile
from collections.abc import Iterable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tuneplane.agent.image_layer import GZIP_TYPES, LayerRefused, apply_layer

GZ = sorted(GZIP_TYPES)[0]
MTIME = 1_700_000_000


def _entry(name: str, kind: bytes = tarfile.REGTYPE, **fields: object) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mtime = MTIME
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    for key, value in fields.items():
        setattr(info, key, value)
    return info


def _layer(path: Path, entries: Iterable[tarfile.TarInfo | tuple[str, bytes]]) -> Path:
    """A gzip layer of ``entries``: TarInfo as it is, (name, data) as a regular file."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for item in entries:
            if isinstance(item, tarfile.TarInfo):
                tar.addfile(item)
            else:
                name, data = item
                tar.addfile(_entry(name, size=len(data)), io.BytesIO(data))
    path.write_bytes(gzip.compress(buffer.getvalue()))
    return path


def _tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` with what it is (never following a link)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = "-> " + os.readlink(path)
            elif path.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = path.read_bytes().decode(errors="replace")
    return found


@pytest.fixture
def sandbox(tmp_path: Path) -> tuple[Path, Path]:
    """A root to unpack into and a directory beside it that no layer may touch."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "passwd").write_text("host's own\n")
    return root, outside


def test_files_directories_links_and_modes_are_as_the_image_says(
    tmp_path: Path, sandbox: tuple[Path, Path]
) -> None:
    root, _ = sandbox
    layer = _layer(tmp_path / "l1", [
        _entry("usr", tarfile.DIRTYPE),
        _entry("usr/bin", tarfile.DIRTYPE, mode=0o555),
        ("./usr/bin/tool", b"#!/bin/sh\n"),
        _entry("usr/bin/sudo", size=0, mode=0o4755),
        _entry("bin", tarfile.SYMTYPE, linkname="usr/bin"),
        _entry("etc/alternatives/python", tarfile.SYMTYPE, linkname="/usr/bin/tool"),
        _entry("usr/bin/tool-again", tarfile.LNKTYPE, linkname="usr/bin/tool"),
        _entry("run/pipe", tarfile.FIFOTYPE),
    ])  # fmt: skip
    applied = apply_layer(layer, GZ, root)
    assert applied.files == 2 and applied.symlinks == 2 and applied.hardlinks == 1
    assert (root / "usr/bin/tool").read_bytes() == b"#!/bin/sh\n"
    assert os.readlink(root / "bin") == "usr/bin"
    # An absolute target is kept as it is: the container resolves it, never the Node.
    assert os.readlink(root / "etc/alternatives/python") == "/usr/bin/tool"
    assert os.stat(root / "usr/bin/tool-again").st_ino == os.stat(root / "usr/bin/tool").st_ino
    assert stat.S_ISFIFO(os.stat(root / "run/pipe").st_mode)
    assert stat.S_IMODE(os.stat(root / "usr/bin").st_mode) == 0o555
    # No file the Node unpacks gives privileges: setuid is dropped.
    assert stat.S_IMODE(os.stat(root / "usr/bin/sudo").st_mode) == 0o755
    assert os.stat(root / "usr/bin/tool").st_mtime == MTIME


def test_whiteouts_hide_what_the_lower_layers_put_there(
    tmp_path: Path, sandbox: tuple[Path, Path]
) -> None:
    root, _ = sandbox
    lower = _layer(tmp_path / "l1", [
        ("etc/keep", b"1"), ("etc/gone", b"2"), ("opt/app/old", b"3"), ("opt/app/sub/deep", b"4"),
    ])  # fmt: skip
    upper = _layer(tmp_path / "l2", [
        ("opt/app/new", b"5"),
        _entry("etc/.wh.gone", size=0),
        _entry("opt/app/.wh..wh..opq", size=0),
    ])  # fmt: skip
    apply_layer(lower, GZ, root)
    applied = apply_layer(upper, GZ, root)
    assert applied.whiteouts == 2
    # The opaque whiteout came after this layer's own file in the stream: it still only hides
    # what the lower layer had.
    assert _tree(root) == {
        "etc": "dir", "etc/keep": "1", "opt": "dir", "opt/app": "dir", "opt/app/new": "5",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        ([("../outside/passwd", b"owned")], "climbs out of the image's root"),
        ([("a/../../outside/passwd", b"owned")], "climbs out of the image's root"),
        (
            [_entry("etc", tarfile.SYMTYPE, linkname="/OUTSIDE"), ("etc/passwd", b"owned")],
            "never writes through a link",
        ),
        (
            [_entry("up", tarfile.SYMTYPE, linkname="../outside"), ("up/passwd", b"owned")],
            "never writes through a link",
        ),
        (
            [_entry("link", tarfile.LNKTYPE, linkname="../outside/passwd")],
            "climbs out of the image's root",
        ),
        (
            [
                _entry("up", tarfile.SYMTYPE, linkname="../outside"),
                _entry("stolen", tarfile.LNKTYPE, linkname="up/passwd"),
            ],
            "never writes through a link",
        ),
        ([_entry("link", tarfile.LNKTYPE, linkname="nowhere")], "is not in the image"),
    ],
)
def test_a_hostile_layer_is_refused_and_writes_nothing_outside(
    tmp_path: Path, sandbox: tuple[Path, Path], entries: list[object], says: str
) -> None:
    root, outside = sandbox
    fixed = [
        _entry(e.name, e.type, linkname=e.linkname.replace("/OUTSIDE", str(outside)))
        if isinstance(e, tarfile.TarInfo)
        else e
        for e in entries
    ]
    before = _tree(outside)
    with pytest.raises(LayerRefused, match=says):
        apply_layer(_layer(tmp_path / "hostile", fixed), GZ, root)  # type: ignore[arg-type]
    assert _tree(outside) == before


def test_a_link_an_earlier_layer_planted_is_never_written_through(
    tmp_path: Path, sandbox: tuple[Path, Path]
) -> None:
    root, outside = sandbox
    apply_layer(_layer(tmp_path / "l1", [_entry("etc", tarfile.SYMTYPE, linkname=str(outside))]),
                GZ, root)  # fmt: skip
    before = _tree(outside)
    for entries in (
        [("etc/passwd", b"owned")],
        [_entry("etc/.wh.passwd", size=0)],
        [_entry("etc/.wh..wh..opq", size=0)],
    ):
        with pytest.raises(LayerRefused, match="never writes through a link"):
            apply_layer(_layer(tmp_path / "l2", entries), GZ, root)
        assert _tree(outside) == before


def test_device_nodes_are_skipped_and_counted(tmp_path: Path, sandbox: tuple[Path, Path]) -> None:
    root, _ = sandbox
    layer = _layer(tmp_path / "l1", [
        _entry("dev", tarfile.DIRTYPE),
        _entry("dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=0),
        _entry("dev/mem", tarfile.CHRTYPE, devmajor=1, devminor=1),
    ])  # fmt: skip
    applied = apply_layer(layer, GZ, root)
    assert applied.devices_skipped == 2
    assert os.listdir(root / "dev") == []


def test_other_media_types_and_broken_streams_are_refused_with_a_sentence(
    tmp_path: Path, sandbox: tuple[Path, Path]
) -> None:
    root, _ = sandbox
    blob = _layer(tmp_path / "l1", [("a", b"1")])
    zstd = "application/vnd.oci.image.layer.v1.tar+zstd"
    with pytest.raises(LayerRefused, match=re.escape(f"media type {zstd!r}")):
        apply_layer(blob, zstd, root)
    blob.write_bytes(blob.read_bytes()[:20])
    with pytest.raises(LayerRefused, match="not a readable tar stream"):
        apply_layer(blob, GZ, root)


# Few names, so that a link and a write through it often meet; targets out of the root often.
# Every target stays inside the test's own folder even when the code under test is broken: the
# sibling OUTSIDE folder, or at most two levels up from a link at most two deep (never "/").
NAMES = st.sampled_from(
    ["a", "etc", "etc/a", "etc/b/a", "../a", "etc/.wh.a", "etc/.wh..wh..opq", "./a", "etc/b"]
)
KINDS = st.sampled_from([tarfile.REGTYPE, tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE,
                         tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE])  # fmt: skip
TARGETS = st.sampled_from(["OUTSIDE", "OUTSIDE/a", "..", "../..", "a", "etc/a"])


@st.composite
def _hostile_entries(draw: st.DrawFn) -> list[tarfile.TarInfo]:
    return [
        _entry(draw(NAMES), draw(KINDS), linkname=draw(TARGETS), size=0)
        for _ in range(draw(st.integers(1, 10)))
    ]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(layers=st.lists(_hostile_entries(), min_size=1, max_size=3))
def test_no_sequence_of_layers_writes_outside_the_root(
    tmp_path: Path, layers: list[list[tarfile.TarInfo]]
) -> None:
    case = Path(os.path.realpath(tmp_path)) / f"case-{os.urandom(6).hex()}"
    root, outside = case / "root", case / "outside"
    root.mkdir(parents=True)
    outside.mkdir()
    (outside / "a").write_text("host")
    before = _tree(outside)
    for i, entries in enumerate(layers):
        for e in entries:
            e.linkname = e.linkname.replace("OUTSIDE", str(outside))
        try:
            apply_layer(_layer(case / f"l{i}", entries), GZ, root)
        except LayerRefused:
            break
    assert _tree(outside) == before
    # Whatever is in the root is in the root: nothing under it is a hard link to a file outside.
    inside = {os.lstat(outside / "a").st_ino}
    for folder, _dirs, files in os.walk(root):
        for name in files:
            assert os.lstat(Path(folder, name)).st_ino not in inside
