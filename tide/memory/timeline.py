"""Draw a memory timeline (`Engine.dump_memory_timeline` / `GET /dump_memory_timeline`) as a PNG.

`tide memory-plot ledger.json -o timeline.png` calls `plot_timeline`. It reads only the JSON (no
engine, no device): reserved and allocated bytes over time as step lines (the value holds until the
next observation), the gap between them (allocator cache / fragmentation) shaded, and every event a
vertical line coloured by kind with a label — lifecycle marks with their kind and detail, allocator
release points with their reason, host stall and freed bytes. Long timelines keep every line but label
only the `max_labels` events with the largest memory change or stall (the title says so); `start` /
`end` (seconds from the first event) zoom in.

matplotlib is an optional dependency (`pip install 'tide[plot]'`); it is drawn with the Agg canvas
directly, so no display and no pyplot state are involved.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from tide.memory.ledger import check_timeline
from tide.memory.observe import SOURCE_CPU_RSS

KIND_COLORS = {
    "pause": "#e67e22",
    "continue": "#27ae60",
    "weight_update": "#8e44ad",
    "release": "#c0392b",
    "resume": "#2980b9",
    "flush_cache": "#7f8c8d",
    "empty_cache": "#111111",  # allocator release points
}
_OTHER_COLORS = ("#16a085", "#d35400", "#2c3e50", "#f39c12", "#7d3c98", "#1abc9c", "#a93226")
_LABEL_PITCH_IN = 0.27  # horizontal room one (two-line, rotated) label needs, in inches
_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))


def format_bytes(n: float) -> str:
    for unit, size in _UNITS:
        if abs(n) >= size or size == 1:
            return f"{n / size:.3g} {unit}" if size > 1 else f"{int(n)} B"
    return f"{n} B"


def load_timeline(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a timeline JSON file (ValueError naming the problem)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{os.fspath(path)!r} is not JSON: {e}") from None
    check_timeline(data)
    return data


def event_label(e: dict[str, Any]) -> str:
    """The annotation of one event."""
    if e["type"] == "release":
        freed = max(0, int(e["reserved_before"]) - int(e["reserved_after"]))
        return (f"empty_cache({e['reason']})\nstall {1000 * float(e['stall_s']):.1f} ms, "
                f"freed {format_bytes(freed)}")
    detail = str(e.get("detail") or "")
    room = max(0, 44 - len(str(e["kind"])))
    if len(detail) > room:
        detail = detail[: max(0, room - 3)] + "..."
    return f"{e['kind']}: {detail}" if detail else str(e["kind"])


def _kind(e: dict[str, Any]) -> str:
    return "empty_cache" if e["type"] == "release" else str(e["kind"])


@dataclass
class TimelinePlot:
    """A drawn timeline: the matplotlib `figure` (not yet saved), the `labels` drawn on it (in time
    order), how many events are in view and how many got a label."""

    figure: Any
    labels: list[str] = field(default_factory=list)
    num_events: int = 0
    num_labelled: int = 0

    def save(self, path: str | os.PathLike[str], dpi: int = 100) -> str:
        self.figure.savefig(os.fspath(path), dpi=dpi, format="png")
        return os.fspath(path)


def _series(events: list[dict[str, Any]], t0: float) -> tuple[list[float], list[int], list[int]]:
    """(t, reserved, allocated) observation points, in time order."""
    xs: list[float] = []
    reserved: list[int] = []
    allocated: list[int] = []
    for e in events:
        if e["type"] == "release":
            alloc = int(e.get("allocated", 0))
            start = float(e.get("start", float(e["time"]) - float(e["stall_s"])))
            for t, r in ((start, e["reserved_before"]), (float(e["time"]), e["reserved_after"])):
                xs.append(t - t0)
                reserved.append(int(r))
                allocated.append(alloc)
        else:
            xs.append(float(e["time"]) - t0)
            reserved.append(int(e["reserved"]))
            allocated.append(int(e["allocated"]))
    return xs, reserved, allocated


def _spread(at: list[float], gap: float) -> list[float]:
    """Label positions (axes fraction, in order) as close to the sorted event positions `at` as
    possible while at least `gap` apart and inside [gap/2, 1 - gap/2]; evenly spaced when they
    cannot all fit."""
    n = len(at)
    if n == 0:
        return []
    if n * gap >= 1.0:
        return [(i + 0.5) / n for i in range(n)]
    out = list(at)
    out[0] = max(out[0], gap / 2)
    for i in range(1, n):
        out[i] = max(out[i], out[i - 1] + gap)
    out[-1] = min(out[-1], 1.0 - gap / 2)
    for i in range(n - 2, -1, -1):
        out[i] = min(out[i], out[i + 1] - gap)
    return out


def _decimate(xs: list[float], series: list[list[int]], buckets: int) -> list[int]:
    """Indices of the points to draw: all when there are few; else per x bucket the first, last,
    minimum and maximum of every series (spikes stay visible; a line holds ~a pixel per bucket)."""
    n = len(xs)
    if n <= 4 * buckets or n < 2 or xs[-1] <= xs[0]:
        return list(range(n))
    lo, span = xs[0], xs[-1] - xs[0]
    keep: set[int] = set()
    start = 0
    while start < n:
        b = min(buckets - 1, int((xs[start] - lo) / span * buckets))
        stop = start
        while stop < n and min(buckets - 1, int((xs[stop] - lo) / span * buckets)) == b:
            stop += 1
        keep.update((start, stop - 1))
        for ys in series:
            seg = range(start, stop)
            keep.add(min(seg, key=ys.__getitem__))
            keep.add(max(seg, key=ys.__getitem__))
        start = stop
    return sorted(keep)


def _pick_labelled(events: list[dict[str, Any]], max_labels: int) -> set[int]:
    """Indices of the events to label: all of them, or the `max_labels` with the largest memory
    change since the previous observation or the longest stall (each scaled to its maximum)."""
    if len(events) <= max_labels:
        return set(range(len(events)))
    deltas: list[float] = []
    stalls: list[float] = []
    prev: tuple[int, int] | None = None
    for e in events:
        if e["type"] == "release":
            now = (int(e["reserved_after"]), int(e.get("allocated", 0)))
            delta = float(abs(int(e["reserved_before"]) - now[0]))
            stalls.append(float(e["stall_s"]))
        else:
            now = (int(e["reserved"]), int(e["allocated"]))
            delta = 0.0 if prev is None else float(abs(now[0] - prev[0]) + abs(now[1] - prev[1]))
            stalls.append(0.0)
        deltas.append(delta)
        prev = now
    dmax, smax = max(deltas) or 1.0, max(stalls) or 1.0
    score = [d / dmax + s / smax for d, s in zip(deltas, stalls)]
    ranked = sorted(range(len(events)), key=lambda i: (-score[i], i))
    return set(ranked[:max_labels])


def render_timeline(data: dict[str, Any], *, title: str | None = None, max_labels: int = 200,
                    start: float | None = None, end: float | None = None) -> TimelinePlot:
    """Draw timeline `data` (the JSON of `MemoryLedger.to_dict`) on a new figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    if max_labels < 0:
        raise ValueError(f"max_labels must be >= 0, got {max_labels}")
    all_events = sorted(check_timeline(data), key=lambda e: float(e.get("start", e["time"])))
    t0 = float(all_events[0].get("start", all_events[0]["time"])) if all_events else 0.0

    def rel(e: dict[str, Any]) -> float:
        return float(e["time"]) - t0

    events = [e for e in all_events if (start is None or rel(e) >= start)
              and (end is None or rel(e) <= end)]
    xs, reserved, allocated = _series(events, t0)
    order = sorted(range(len(xs)), key=xs.__getitem__)  # a release's start may precede a mark
    xs, reserved, allocated = ([xs[i] for i in order], [reserved[i] for i in order],
                               [allocated[i] for i in order])
    cpu_only = all(e.get("source") == SOURCE_CPU_RSS for e in events) and bool(events)
    peak = max(reserved + allocated, default=0)
    unit, scale = next(((u, s) for u, s in _UNITS if peak >= s), ("B", 1))

    if events:
        lo, hi = min(xs[0], rel(events[0])), max(xs[-1], rel(events[-1]))
        pad = max(0.03 * (hi - lo), 0.5 if hi == lo else 0.0)
        lo, hi = lo - pad, hi + pad
    else:
        lo, hi = 0.0, 1.0
    labelled = _pick_labelled(events, max_labels)
    width = min(80.0, max(11.0, 4.0 + _LABEL_PITCH_IN * len(labelled)))
    fig = Figure(figsize=(width, 8.0))
    FigureCanvasAgg(fig)
    # Top strip: event labels (spread apart where events crowd, each tied to its event by a leader
    # line); bottom: the memory lines with every event as a vertical line.
    strip, ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1.25, 2.0],
                                                             "hspace": 0.04})
    left, right = 0.6 / width, 1.0 - 2.6 / width
    fig.subplots_adjust(left=left, right=right, top=0.92, bottom=0.08)
    handles: list[Any] = []

    keep = _decimate(xs, [reserved, allocated], int(width * 100))
    xs, reserved, allocated = ([xs[i] for i in keep], [reserved[i] for i in keep],
                               [allocated[i] for i in keep])
    if xs:
        y_alloc = [a / scale for a in allocated]
        alloc_name = "allocated (process RSS, no CUDA)" if cpu_only else "allocated"
        handles += ax.step(xs, y_alloc, where="post", color="#2471a3", lw=1.6, label=alloc_name)
        if not cpu_only:
            y_res = [r / scale for r in reserved]
            handles += ax.step(xs, y_res, where="post", color="#cb4335", lw=1.6, label="reserved")
            handles.append(ax.fill_between(
                xs, y_alloc, y_res, step="post", where=[r >= a for r, a in zip(y_res, y_alloc)],
                color="#f5b7b1", alpha=0.45, label="reserved − allocated"))

    by_kind: dict[str, list[float]] = {}
    for e in events:
        by_kind.setdefault(_kind(e), []).append(rel(e))
    colors = dict(KIND_COLORS)
    extra = iter(_OTHER_COLORS * (1 + len(by_kind) // len(_OTHER_COLORS)))
    for kind in sorted(by_kind):
        color = colors.setdefault(kind, next(extra))
        style: Literal["dashed", "solid"] = "dashed" if kind == "empty_cache" else "solid"
        # One line per pixel column is all that can show; thousands of events stay fast.
        px = (hi - lo) / max(1.0, width * 100)
        cols = sorted({round((x - lo) / px) for x in by_kind[kind]})
        ax.vlines([lo + c * px for c in cols], 0, 1, transform=ax.get_xaxis_transform(), colors=color,
                  linestyles=style, lw=0.9, alpha=0.7)
        handles.append(Line2D([], [], color=color, linestyle=style, lw=1.2,
                              label=f"{kind} ({len(by_kind[kind])})"))

    releases = [e for e in events if e["type"] == "release"]
    if releases:
        handles.append(ax.scatter(
            [rel(e) for e in releases], [int(e["reserved_after"]) / scale for e in releases],
            marker="v", color=colors["empty_cache"], s=28, zorder=5,
            label="release point (reserved after)"))

    if events:
        ax.set_xlim(lo, hi)
        ax.set_ylim(0, max(peak / scale * 1.1, 1e-9))
    else:
        ax.text(0.5, 0.5, "no events recorded", transform=ax.transAxes, ha="center",
                va="center", fontsize=12, color="#7f8c8d")

    chosen = [e for i, e in enumerate(events) if i in labelled]
    at = [(rel(e) - lo) / (hi - lo) for e in chosen]
    slots = _spread(at, _LABEL_PITCH_IN / max(1e-6, width * (right - left)))
    labels: list[str] = []
    for e, x, slot in zip(chosen, at, slots):
        text = event_label(e)
        color = colors[_kind(e)]
        strip.plot([x, x, slot], [0.0, 0.04, 0.1], transform=strip.transAxes, color=color,
                   lw=0.8, alpha=0.8, clip_on=False)
        strip.text(slot, 0.11, text, transform=strip.transAxes, rotation=90, va="bottom",
                   ha="center", fontsize=7, color=color, clip_on=True)
        labels.append(text)

    strip.set_yticks([])
    strip.set_ylim(0, 1)
    strip.tick_params(axis="x", which="both", bottom=False)
    ax.set_xlabel("seconds since the first event")
    ax.set_ylabel(f"device memory ({unit})" if not cpu_only else f"process RSS ({unit})")
    ax.grid(True, alpha=0.25)
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8,
                  frameon=False)

    heading = title or f"tide memory timeline (pid {data.get('pid', '?')})"
    facts = [f"{len(events)} events"]
    if len(labelled) < len(events):
        facts.append(f"labels on the {len(labelled)} with the largest memory change or stall "
                     "(zoom with --start/--end)")
    if data.get("dropped_events"):
        facts.append(f"{data['dropped_events']} oldest events dropped by the ledger bound")
    if cpu_only:
        facts.append("CPU: allocated = process RSS, reserved = 0")
    fig.suptitle(heading, fontsize=12, x=0.01, ha="left")
    strip.set_title("; ".join(facts), fontsize=8, loc="left")
    return TimelinePlot(fig, labels, len(events), len(labels))


def plot_timeline(src: str | os.PathLike[str] | dict[str, Any], out: str | os.PathLike[str], *,
                  title: str | None = None, max_labels: int = 200, start: float | None = None,
                  end: float | None = None, dpi: int = 100) -> TimelinePlot:
    """Draw the timeline in `src` (a JSON path, or its data) and write it to `out` as PNG."""
    data = src if isinstance(src, dict) else load_timeline(src)
    plot = render_timeline(data, title=title, max_labels=max_labels, start=start, end=end)
    plot.save(out, dpi=dpi)
    return plot
