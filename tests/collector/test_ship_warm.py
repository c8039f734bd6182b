"""The collector template builds betterproto's per-class metadata of what a collector ships
once, before it forks: a fresh interpreter shows the classes cold, then warm after
``warm_messages``, and what it encodes decodes to the same request."""

from __future__ import annotations

import subprocess
import sys

from tuneplane.collector.ship_wire import Progress, ship_request
from tuneplane.collector.spool import SpooledPoint
from tuneplane.proto import v1

SHIPPED = ("ShipRequest", "PointColumns", "RestartMark", "HParamsMark", "HParam", "MemberRef",
           "CollectorProgress", "ShipReply", "RefusedPoint")  # fmt: skip

PROBE = f"""
import sys
from tuneplane.collector import ship_wire
from tuneplane.proto import v1
names = {SHIPPED!r}
def warm():
    return [n for n in names if "_betterproto_meta" in vars(getattr(v1, n))]
before = warm()
ship_wire.warm_messages()
print(len(before), len(warm()))
"""


def test_warm_messages_builds_the_metadata_of_every_shipped_class() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    before, after = map(int, done.stdout.split())
    assert before < len(SHIPPED) and after == len(SHIPPED)


def test_a_ship_request_round_trips_through_its_bytes() -> None:
    points = [SpooledPoint(7, "tb:run1", 40, 2, "loss", 3, None, 0.25)]
    request = ship_request(("run-1", 2, 1), points, Progress(5, True, False, False, 1, 0))
    decoded = v1.ShipRequest().parse(bytes(request))
    assert decoded == request
    assert decoded.member.member_index == 1 and decoded.progress.spool_points == 5
    assert decoded.columns.strings == ["tb:run1", "loss"]
