"""The memory ledger as a timeline: lifecycle marks, bounded storage with exact totals, the JSON dump,
and `tide memory-plot` drawing it (reserved/allocated lines, every event annotated)."""

from __future__ import annotations

import json
import threading
import types

import pytest
import torch

from tide.memory import ledger as ledger_module
from tide.memory.ledger import (
    TIMELINE_FORMAT,
    MemoryLedger,
    MemoryMark,
    ReleaseEvent,
    check_timeline,
)
from tide.memory.release import empty_device_cache

pytest.importorskip("matplotlib")

from tide.memory.timeline import event_label, plot_timeline, render_timeline  # noqa: E402

GiB = 1 << 30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _release(reason: str, stall: float, before: int, after: int, t: float,
             allocated: int = 0) -> ReleaseEvent:
    return ReleaseEvent(reason, stall, before, after, t, allocated)


# ---------------------------------------------------------------- marks
def test_mark_on_cpu_records_rss_as_allocated(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    ledger = MemoryLedger()
    ledger.mark("pause", "mode=retract")
    ledger.mark("continue")
    first, second = ledger.marks
    assert (first.kind, first.detail, second.kind, second.detail) == (
        "pause", "mode=retract", "continue", "")
    assert first.source == "cpu_rss" and first.reserved == 0
    assert first.allocated > 1 << 20  # this process's RSS: a Python with torch is far above 1 MiB
    assert first.time <= second.time
    assert ledger.events == []  # marks are not release events
    data = ledger.to_dict()
    assert data["memory_source"] == "cpu_rss" and "RSS" in data["notes"]["cpu_rss"]


def test_mark_with_cuda_records_reserved_and_allocated(monkeypatch):
    fake = {"reserved": 7 * GiB, "allocated": 5 * GiB}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: fake["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: fake["allocated"])
    ledger = MemoryLedger()
    ledger.mark("release", "tags=['kv_cache']")
    fake.update(reserved=9 * GiB, allocated=8 * GiB)
    ledger.mark("resume", "tags=['kv_cache']")
    got = [(m.kind, m.reserved, m.allocated, m.source) for m in ledger.marks]
    assert got == [("release", 7 * GiB, 5 * GiB, "cuda"), ("resume", 9 * GiB, 8 * GiB, "cuda")]


def test_mark_needs_a_kind():
    ledger = MemoryLedger()
    for bad in ("", None):
        with pytest.raises(ValueError, match="kind"):
            ledger.mark(bad)
    assert ledger.timeline() == []
    with pytest.raises(ValueError, match="max_events"):
        MemoryLedger(max_events=0)


def test_default_ledger_is_bounded():
    ledger = MemoryLedger()
    assert ledger.max_events == ledger_module.DEFAULT_MAX_EVENTS == 100_000
    ledger.mark("unit_test", "a ledger of its own")
    assert [m.kind for m in ledger.marks] == ["unit_test"]
    assert ledger.mark_counts() == {"unit_test": 1}


# ---------------------------------------------------------------- bounded storage, exact totals
def test_bounded_timeline_keeps_newest_and_totals_stay_exact():
    ledger = MemoryLedger(max_events=5)
    stalls = [0.001 * (i + 1) for i in range(7)]
    for i, stall in enumerate(stalls):
        ledger.record(_release("weight_update" if i % 2 else "flush_cache", stall,
                               1000 + i, 400, float(i)))
        ledger.mark("weight_update" if i % 2 else "pause", f"step {i}")
    entries = ledger.timeline()
    assert len(entries) == 5 and ledger.dropped == 14 - 5
    # the newest five, in the order recorded (release, mark alternating, ending with step 6's mark)
    assert [type(e).__name__ for e in entries] == ["MemoryMark", "ReleaseEvent", "MemoryMark",
                                                   "ReleaseEvent", "MemoryMark"]
    assert [e.detail for e in entries if isinstance(e, MemoryMark)] == ["step 4", "step 5", "step 6"]
    assert [e.time for e in ledger.events] == [5.0, 6.0]
    totals = ledger.totals()
    odd = [i for i in range(7) if i % 2]
    even = [i for i in range(7) if not i % 2]
    assert totals["weight_update"]["count"] == len(odd)
    assert totals["flush_cache"]["count"] == len(even)
    assert totals["weight_update"]["stall_s"] == pytest.approx(sum(stalls[i] for i in odd))
    assert totals["flush_cache"]["stall_s"] == pytest.approx(sum(stalls[i] for i in even))
    assert totals["weight_update"]["freed_bytes"] == sum(1000 + i - 400 for i in odd)
    assert totals["flush_cache"]["freed_bytes"] == sum(1000 + i - 400 for i in even)
    assert ledger.mark_counts() == {"pause": 4, "weight_update": 3}
    data = ledger.to_dict()
    assert data["dropped_events"] == 9 and data["max_events"] == 5 and len(data["events"]) == 5
    assert data["release_totals"] == totals


def test_totals_exact_over_thousands_of_updates_from_threads():
    ledger = MemoryLedger(max_events=100)
    per_thread = 2000

    def work(k: int) -> None:
        for i in range(per_thread):
            ledger.record(_release("weight_update", 0.0, 10, 4, float(i)))
            ledger.mark("weight_update", f"t{k}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ledger.timeline()) == 100
    assert ledger.dropped == 4 * per_thread * 2 - 100
    assert ledger.totals()["weight_update"] == {"count": 4 * per_thread, "stall_s": 0.0,
                                                "freed_bytes": 4 * per_thread * 6}
    assert ledger.mark_counts() == {"weight_update": 4 * per_thread}


def test_empty_device_cache_puts_release_points_on_the_timeline():
    reserved = iter([3 * GiB, GiB])
    fake = types.SimpleNamespace(empty_cache=lambda: None, is_available=lambda: True,
                                 memory_reserved=lambda: next(reserved),
                                 memory_allocated=lambda: GiB // 2)
    ledger = MemoryLedger()
    assert empty_device_cache(fake, reason="unit-timeline", ledger=ledger)
    [event] = ledger.events
    assert (event.reserved_before, event.reserved_after, event.allocated_after) == (
        3 * GiB, GiB, GiB // 2)
    [as_json] = [e for e in ledger.to_dict()["events"] if e["type"] == "release"]
    assert as_json["freed_bytes"] == 2 * GiB and as_json["allocated"] == GiB // 2
    assert as_json["start"] == pytest.approx(as_json["time"] - as_json["stall_s"])


# ---------------------------------------------------------------- JSON round trip
def test_dump_json_round_trip(tmp_path):
    ledger = MemoryLedger(max_events=50)
    ledger.mark("pause", "mode=in_place")
    ledger.record(_release("weight_update", 0.312, 24 * GiB, 18 * GiB, 100.0, 17 * GiB))
    ledger.mark("release", "tags=['kv_cache', 'weights']")
    path = ledger.dump_json(tmp_path / "ledger.json")
    data = json.loads((tmp_path / "ledger.json").read_text())
    assert path.endswith("ledger.json") and data["format"] == TIMELINE_FORMAT
    assert [e["type"] for e in data["events"]] == ["mark", "release", "mark"]
    assert [e.get("kind", e.get("reason")) for e in data["events"]] == [
        "pause", "weight_update", "release"]
    rel = data["events"][1]
    assert (rel["stall_s"], rel["reserved_before"], rel["reserved_after"], rel["allocated"],
            rel["freed_bytes"]) == (0.312, 24 * GiB, 18 * GiB, 17 * GiB, 6 * GiB)
    assert data["release_totals"] == {"weight_update": {"count": 1, "stall_s": 0.312,
                                                        "freed_bytes": 6 * GiB}}
    again = MemoryLedger.from_dict(data).to_dict()
    for key in ("events", "release_totals", "mark_counts", "dropped_events", "max_events"):
        assert again[key] == data[key], key
    assert not list(tmp_path.glob("*.tmp-*"))  # written atomically, no temp file left


@pytest.mark.parametrize("bad,needle", [
    ({"events": []}, "not a tide memory timeline"),
    ([], "not a tide memory timeline"),
    ({"format": TIMELINE_FORMAT}, "'events' must be a list"),
    ({"format": TIMELINE_FORMAT, "events": [{"type": "oops", "time": 1}]}, "events[0]"),
    ({"format": TIMELINE_FORMAT, "events": [{"type": "mark", "time": 1, "kind": "x"}]}, "lacks"),
])
def test_check_timeline_names_the_problem(bad, needle):
    with pytest.raises(ValueError) as e:
        check_timeline(bad)
    assert needle in str(e.value)


# ---------------------------------------------------------------- the plot
def _rl_timeline() -> dict:
    """Two RL iterations of a colocated engine: pause, release, staged resume, update, continue."""
    ledger = MemoryLedger()
    t = 1000.0
    events = []

    def mark(kind, detail, reserved, allocated):
        nonlocal t
        t += 1.0
        events.append(MemoryMark(kind, detail, reserved, allocated, t))

    for step in range(2):
        mark("pause", "mode=retract", 100 * GiB, 98 * GiB)
        mark("release", "tags=['kv_cache', 'weights']", 3 * GiB, 1 * GiB)
        mark("resume", "tags=['weights']", 20 * GiB, 17 * GiB)
        mark("weight_update", f"step-{step}", 24 * GiB, 17 * GiB)
        t += 0.5
        events.append(_release("weight_update", 0.312, 24 * GiB, 18 * GiB, t, 17 * GiB))
        mark("resume", "tags=['kv_cache']", 100 * GiB, 97 * GiB)
        mark("continue", "", 100 * GiB, 97 * GiB)
    for e in events:
        if isinstance(e, ReleaseEvent):
            ledger.record(e)
        else:
            ledger._append(e)  # marks with chosen figures (mark() reads the live device)
    return json.loads(json.dumps(ledger.to_dict()))


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_render_draws_memory_lines_and_labels_every_event():
    data = _rl_timeline()
    plot = render_timeline(data)
    events = data["events"]
    assert plot.num_events == len(events) == 14 and plot.num_labelled == 14
    assert plot.labels == [event_label(e) for e in events]
    drawn = _texts(plot.figure)
    for label in plot.labels:
        assert label in drawn
    assert "empty_cache(weight_update)\nstall 312.0 ms, freed 6 GiB" in drawn
    assert "release: tags=['kv_cache', 'weights']" in drawn
    assert "weight_update: step-1" in drawn
    # reserved and allocated lines, in GiB, reaching the timeline's figures
    main = plot.figure.axes[1]
    lines = {line.get_label(): line for line in main.get_lines()}
    assert max(lines["reserved"].get_ydata()) == pytest.approx(100)
    assert min(lines["reserved"].get_ydata()) == pytest.approx(3)
    assert max(lines["allocated"].get_ydata()) == pytest.approx(98)
    assert main.get_ylabel() == "device memory (GiB)"
    # one vertical line per event (collections of the main axes), by kind
    segments = sum(len(c.get_segments()) for c in main.collections if hasattr(c, "get_segments")
                   and c.get_segments() and len(c.get_segments()[0]) == 2)
    assert segments == len(events)


def test_memory_plot_cli_writes_a_png(tmp_path, capsys):
    from tide.cli import main

    src = tmp_path / "ledger.json"
    src.write_text(json.dumps(_rl_timeline()))
    out = tmp_path / "timeline.png"
    assert main(["memory-plot", str(src), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 10_000
    assert "14 events, 14 labelled" in capsys.readouterr().err
    assert main(["memory-plot", str(src)]) == 0  # default output: ledger.png next to the JSON
    assert (tmp_path / "ledger.png").read_bytes()[:8] == PNG_MAGIC


def test_memory_plot_cli_rejects_bad_input(tmp_path, capsys):
    from tide.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hello": 1}))
    for path in (bad, tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as e:
            main(["memory-plot", str(path), "-o", str(tmp_path / "x.png")])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "not a tide memory timeline" in err and "missing.json" in err
    assert not (tmp_path / "x.png").exists()


def test_many_events_keep_every_line_and_label_the_biggest_changes():
    ledger = MemoryLedger()
    for i in range(60):
        ledger._append(MemoryMark("weight_update", f"v{i}", 10 * GiB, 8 * GiB, 100.0 + i))
    ledger.record(_release("oom_recovery", 2.5, 30 * GiB, 10 * GiB, 130.5, 8 * GiB))
    ledger._append(MemoryMark("release", "all", GiB, GiB // 2, 131.0))
    plot = render_timeline(ledger.to_dict(), max_labels=3)
    assert plot.num_events == 62 and plot.num_labelled == 3
    assert "empty_cache(oom_recovery)\nstall 2500.0 ms, freed 20 GiB" in plot.labels
    assert "release: all" in plot.labels
    assert "labels on the 3" in plot.figure.axes[0].get_title(loc="left")
    zoom = render_timeline(ledger.to_dict(), start=29.0, end=31.5)  # seconds from the first event
    assert sorted(zoom.labels) == sorted([
        "weight_update: v29", "weight_update: v30", "weight_update: v31",
        "empty_cache(oom_recovery)\nstall 2500.0 ms, freed 20 GiB", "release: all"])


def test_cpu_and_empty_timelines_still_plot(tmp_path):
    ledger = MemoryLedger()
    ledger.mark("pause", "cpu")
    ledger.mark("resume", "cpu")
    data = ledger.to_dict()
    plot = plot_timeline(data, tmp_path / "cpu.png")
    assert plot.labels == ["pause: cpu", "resume: cpu"]
    assert plot.figure.axes[1].get_ylabel().startswith("process RSS")
    assert (tmp_path / "cpu.png").read_bytes()[:8] == PNG_MAGIC
    empty = plot_timeline(MemoryLedger().to_dict(), tmp_path / "empty.png")
    assert empty.num_events == 0 and "no events recorded" in _texts(empty.figure)
    assert (tmp_path / "empty.png").read_bytes()[:8] == PNG_MAGIC
