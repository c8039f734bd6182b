"""Scrape a real TunePlane metrics listener over HTTP and read it with prometheus_client's parser.

Rules: nothing here knows a metric's meaning; a test asks for a sample by its exposed name and
labels and gets its value (None when it is not exposed).
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterable

import attrs
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

SCRAPE_TIMEOUT_S = 10.0
METRIC_NAME = re.compile(r"\btuneplane_(?:node|coordinator)_[a-z0-9_]*[a-z0-9]\b")


@attrs.frozen
class Scrape:
    """One exposition: its text, its families' names and every sample."""

    text: str
    families: frozenset[str]
    samples: tuple[Sample, ...]

    def value(self, name: str, **labels: str) -> float | None:
        """The value of the sample ``name`` whose labels include ``labels``; None if absent."""
        for sample in self.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
        return None

    def names(self) -> frozenset[str]:
        """Every sample name and family name exposed."""
        return frozenset(s.name for s in self.samples) | self.families


def scrape(address: str) -> Scrape:
    """GET ``http://<address>/metrics`` and parse it."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=SCRAPE_TIMEOUT_S) as reply:
        text = reply.read().decode("utf-8")
    families = list(text_string_to_metric_families(text))
    return Scrape(
        text=text,
        families=frozenset(f.name for f in families),
        samples=tuple(s for f in families for s in f.samples),
    )


def names_in(expressions: Iterable[str]) -> set[str]:
    """The ``tuneplane_*`` metric names an expression (PromQL, a document) mentions."""
    return {name for text in expressions for name in METRIC_NAME.findall(text)}
