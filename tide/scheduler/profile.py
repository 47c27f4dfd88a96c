"""torch.profiler over the forwards of every rank, on request (sglang's `start_profile` /
`stop_profile`): `Engine.start_profile(...)` starts a profiler on each tensor-parallel rank, and
`Engine.stop_profile()` (or the scheduler, after `num_steps` forwards) stops them. Each rank writes
two files into `output_dir`:

- `{profile_id}-TP-{rank}.trace.json`: the Chrome trace (chrome://tracing, Perfetto);
- `{profile_id}-TP-{rank}.kernels.json`: every operator and kernel with its call count and total
  device and host microseconds, largest device time first, to compare ranks without a trace viewer.

Nothing is profiled unless asked, and the serving path has no profiling code of its own.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

ACTIVITIES = ("CPU", "GPU")
# A profile holds every event in host memory until it stops, and the stop writes them from the
# serving loop: a few thousand forwards (the standard 256-request workload is ~1,050) at most.
MAX_NUM_STEPS = 4096
_PROFILE_ID = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9._\-]{0,127}")


def default_output_dir() -> str:
    """Where profiles go unless the caller says: `$TIDE_TORCH_PROFILER_DIR`, else
    `{tempdir}/tide-profile-{uid}`, this user's own directory (mode 0700; `RankProfile` refuses
    one that another user owns or that is a link). The server always writes here: a request
    never picks a path."""
    return os.environ.get("TIDE_TORCH_PROFILER_DIR",
                          os.path.join(tempfile.gettempdir(), f"tide-profile-{os.getuid()}"))


def _make_private_dir(path: str) -> None:
    """Create `path` (0700) if needed; RuntimeError if it is a link or not this user's, where
    another user could have planted links to files the profile would overwrite."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise RuntimeError(f"profile directory {path} is not a directory")
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"profile directory {path} must belong to this user and not be "
                           "writable by others")


@dataclass(frozen=True)
class ProfileOptions:
    """What `start_profile` records. `output_dir`: "" for `default_output_dir()`. `num_steps`:
    stop by itself after that many forwards (None: at `stop_profile`). `activities`: any of "CPU"
    (host operators) and "GPU" (kernels; where the device is a GPU); None for both."""

    output_dir: str = ""
    num_steps: int | None = None
    activities: tuple[str, ...] | None = None
    record_shapes: bool = False
    with_stack: bool = False
    profile_id: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.output_dir, str):
            raise ValueError(f"output_dir must be a path, got {self.output_dir!r}")
        if not self.output_dir:
            object.__setattr__(self, "output_dir", default_output_dir())
        if self.num_steps is not None and (isinstance(self.num_steps, bool)
                                           or not isinstance(self.num_steps, int)
                                           or not 1 <= self.num_steps <= MAX_NUM_STEPS):
            raise ValueError(f"num_steps must be an integer in [1, {MAX_NUM_STEPS}] or None, "
                             f"got {self.num_steps!r}")
        acts = ACTIVITIES if self.activities is None else tuple(self.activities)
        if not acts or any(a not in ACTIVITIES for a in acts):
            raise ValueError(f"activities must be a non-empty subset of {list(ACTIVITIES)}, "
                             f"got {list(acts)}")
        object.__setattr__(self, "activities", acts)
        if not self.profile_id:
            object.__setattr__(self, "profile_id", str(int(time.time())))
        if not isinstance(self.profile_id, str) or not _PROFILE_ID.fullmatch(self.profile_id):
            raise ValueError("profile_id must be 1-128 letters, digits, '.', '_' or '-' (not "
                             f"starting with '.'), got {self.profile_id!r}")


class RankProfile:
    """One rank's profiler, between `start` and `stop`."""

    def __init__(self, options: ProfileOptions, rank: int, device: torch.device) -> None:
        acts = options.activities or ACTIVITIES
        activities = [torch.profiler.ProfilerActivity.CPU] if "CPU" in acts else []
        if "GPU" in acts and device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.options, self.rank = options, rank
        _make_private_dir(options.output_dir)
        self._profiler = torch.profiler.profile(activities=activities,
                                                record_shapes=options.record_shapes,
                                                with_stack=options.with_stack)
        self._profiler.start()

    def stop(self) -> list[str]:
        """Stop and write this rank's trace and summary; their paths."""
        self._profiler.stop()
        base = os.path.join(self.options.output_dir,
                            f"{self.options.profile_id}-TP-{self.rank}")
        trace = f"{base}.trace.json"
        self._profiler.export_chrome_trace(trace)
        rows: list[dict[str, Any]] = []
        for event in self._profiler.key_averages():
            rows.append({"name": event.key, "count": event.count,
                         "device_us": float(getattr(event, "device_time_total",
                                                    getattr(event, "cuda_time_total", 0.0))),
                         "host_us": float(event.cpu_time_total)})
        rows.sort(key=lambda r: (-r["device_us"], -r["host_us"]))
        summary = f"{base}.kernels.json"
        with open(summary, "w") as f:
            json.dump({"rank": self.rank, "events": rows}, f)
        return [trace, summary]
