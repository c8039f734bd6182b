"""A terminal line chart of a downsampled series, drawn by hand in plain characters.

Rules:
- Pure: buckets in, lines of text out (no terminal I/O), so it is tested on its own.
- Spikes survive: each column draws the whole min..max range of the buckets that fall in it
  (``│``) and marks the last value (``•``); nothing is averaged away.
- Only finite values set the scale; NaN and infinities are counted and named under the chart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..downsample import Bucket

RANGE = "│"
LAST = "•"


def _label(value: float) -> str:
    return f"{value:.4g}"


def draw(buckets: Sequence[Bucket], width: int = 80, height: int = 12) -> list[str]:
    """The chart's lines; at least 20 columns and 3 rows are drawn whatever is asked."""
    height = max(height, 3)
    finite = [
        v for b in buckets for v in (b.min, b.max, b.last) if not math.isnan(v) and math.isfinite(v)
    ]
    if not buckets:
        return ["(no points)"]
    if not finite:
        count = sum(b.count for b in buckets)
        return [f"(no finite values to draw: all {count} points are NaN or ±inf)"]
    lo, hi = min(finite), max(finite)
    if lo == hi:
        pad = abs(lo) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
    labels = [_label(hi), _label((hi + lo) / 2), _label(lo)]
    margin = max(len(s) for s in labels)
    plot_w = max(width - margin - 2, 20)
    s_lo = min(b.first_step for b in buckets)
    s_hi = max(b.last_step for b in buckets)
    span = max(s_hi - s_lo, 1)

    def row(value: float) -> int:
        return round((hi - value) / (hi - lo) * (height - 1))

    # Per column: the lowest and highest finite value and the last value (at the largest step).
    lows: dict[int, float] = {}
    highs: dict[int, float] = {}
    lasts: dict[int, tuple[int, float]] = {}
    for b in buckets:
        col = (b.last_step - s_lo) * (plot_w - 1) // span
        for v in (b.min, b.max):
            if math.isfinite(v):
                lows[col] = min(lows.get(col, v), v)
                highs[col] = max(highs.get(col, v), v)
        if math.isfinite(b.last) and (col not in lasts or b.last_step >= lasts[col][0]):
            lasts[col] = (b.last_step, b.last)
    grid = [[" "] * plot_w for _ in range(height)]
    for col, low in lows.items():
        for r in range(row(highs[col]), row(low) + 1):
            grid[r][col] = RANGE
    for col, (_, value) in lasts.items():
        grid[row(value)][col] = LAST
    lines = []
    for r in range(height):
        label = labels[0] if r == 0 else labels[2] if r == height - 1 else ""
        if r == (height - 1) // 2 and height > 2:
            label = labels[1]
        lines.append(f"{label.rjust(margin)} ┤{''.join(grid[r])}")
    lines.append(" " * margin + " └" + "─" * plot_w)
    left, right = f"step {s_lo}", str(s_hi)
    gap = max(plot_w - len(left) - len(right), 1)
    lines.append(" " * (margin + 2) + left + " " * gap + right)
    odd = sum(1 for b in buckets for v in (b.min, b.max, b.last) if not math.isfinite(v))
    if odd:
        lines.append(f"(NaN or ±inf in {odd} bucket values; they are not drawn)")
    return lines
