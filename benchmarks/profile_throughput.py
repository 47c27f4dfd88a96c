"""Where does offline throughput go? `python -m benchmarks.profile_throughput [--shape S] [--out DIR]`.

One run of the standard workload (256 requests, prompt and output lengths uniform in [100, 1024],
seed 0, ignore_eos, greedy; `load_format="dummy"`) through `Engine.generate`, instrumented from the
outside (the engine's methods are wrapped on its instances for the run and restored afterwards; the
engine has no profiling code), reports:

- wall time and throughput; steps by kind (prefill, mixed prefill+decode, decode; decode steps
  launched ahead by the overlap schedule);
- device: busy fraction (device time of the steps' forward + sampling ÷ wall), forward time in prefill
  vs decode steps, the idle gaps between consecutive steps (CUDA events around each step's forward
  and sampling; on CPU the same spans timed on the host);
- within prefill and decode forwards: attention vs GEMM vs other kernels (a second run of the same
  workload under `torch.profiler`, kernels attributed to the step kind that launched them; on CPU the
  operators' self time). `--no-kernels` skips it, `--kernel-requests N` profiles the first N requests;
- host time per scheduler step, exclusive, split into scheduling, batch building, launching the forward,
  sampling, waiting for the sampled tokens (the one sync of a step), output processing (tokens, stop
  checks, KV release), the rest of `step()`, and the time between steps (the caller's loop).

Writes profile-<shape>.json into --out and prints a table. `--quick` runs the built-in demo model with
a few short requests (CPU-friendly; the CPU test uses it). `--engine k=v` passes engine options
(e.g. `--engine disable_overlap_schedule=true --engine enable_mixed_chunk=true`). `--temperature 1
--logprobs` samples as an RL rollout does instead of greedy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.run import engine_options, workload

SECTIONS = ("schedule", "batch_build", "launch", "sampling", "token_sync", "output_processing",
            "other")
KERNEL_CLASSES = ("attention", "gemm", "communication", "other")
_MISSING = object()
_ATTENTION = ("attn", "attention", "sdpa", "scaled_dot_product", "flash", "_decode_stage",
              "_extend_kernel")
_GEMM = ("gemm", "gemv", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "cutlass",
         "xmma", "cublas", "nvjet", "sm90_", "sm80_", "sm100_")


_COMMUNICATION = ("nccl", "one_shot", "allreduce", "all_reduce", "allgather")


def kernel_class(name: str) -> str:
    """attention, gemm, communication (the ranks' sums and gathers under tensor parallelism) or
    other, from a kernel's (or CPU operator's) name."""
    n = name.lower()
    if any(k in n for k in _COMMUNICATION):
        return "communication"
    if any(k in n for k in _ATTENTION):
        return "attention"
    if any(k in n for k in _GEMM):
        return "gemm"
    return "other"


def batch_kind(batch: Any) -> str:
    if batch.is_decode:
        return "decode"
    return "mixed" if batch.num_decode else "prefill"


@dataclass
class StepRecord:
    """One `Scheduler.step()` call: host seconds per section (exclusive), the batch it launched."""

    start: float
    end: float = 0.0
    host: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    kind: str = "none"  # kind of the batch launched in this step
    tokens: int = 0  # new tokens of that batch
    events: tuple[Any, Any, Any] | None = None  # device: start, after the model, after sampling
    device_s: tuple[float, float] | None = None  # CPU: model seconds, sampling seconds


class Instrument:
    """Wraps the engine's hot-path methods on its instances (and `DeviceSample.to_output` on the
    class) for the duration of a `with` block; exclusive host time per section, per step."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.sched = engine.scheduler
        # Under tensor parallelism rank 0's own worker (`local`) samples and runs the model; the
        # group's forward (which sends the batch to the other ranks first) is timed as the forward.
        self.group = self.sched.worker
        self.worker = getattr(self.group, "local", self.group)
        self.runner = self.worker.model_runner
        self.cuda = self.runner.device.type == "cuda"
        self.steps: list[StepRecord] = []
        self._stack: list[float] = []
        self._current: StepRecord | None = None
        self._patched: list[tuple[Any, str, Any]] = []

    # ---- patching
    def _patch(self, obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        saved = vars(obj).get(name, _MISSING)
        setattr(obj, name, make(getattr(obj, name)))
        self._patched.append((obj, name, saved))

    def _timed(self, section: str) -> Callable[[Callable], Callable]:
        def make(fn: Callable) -> Callable:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                self._stack.append(0.0)
                try:
                    return fn(*args, **kwargs)
                finally:
                    dt = time.perf_counter() - t0
                    child = self._stack.pop()
                    if self._current is not None:
                        self._current.host[section] += dt - child
                    if self._stack:
                        self._stack[-1] += dt
            return wrapped
        return make

    def _step(self, fn: Callable) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            rec = StepRecord(time.perf_counter())
            self._current = rec
            self._stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                rec.end = time.perf_counter()
                child = self._stack.pop()
                rec.host["other"] += (rec.end - rec.start) - child
                self._current = None
                self.steps.append(rec)
        return wrapped

    def _forward(self, fn: Callable) -> Callable:
        """worker.forward / forward_launch: the step's device span, start to after sampling."""
        def wrapped(batch: Any) -> Any:
            rec = self._current
            if rec is not None:
                rec.kind = batch_kind(batch)
                rec.tokens = sum(batch.extend_lens)
            if self.cuda:
                evs = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
                evs[0].record()
                self._mid = evs[1]
                out = fn(batch)
                evs[2].record()
                if rec is not None:
                    rec.events = evs  # type: ignore[assignment]
                return out
            t0 = time.perf_counter()
            self._model_end = t0
            out = fn(batch)
            t2 = time.perf_counter()
            if rec is not None:
                rec.device_s = (self._model_end - t0, t2 - self._model_end)
            return out
        return wrapped

    def _run_model(self, fn: Callable) -> Callable:
        def wrapped(batch: Any) -> Any:
            out = fn(batch)
            if self.cuda:
                self._mid.record()
            else:
                self._model_end = time.perf_counter()
            return out
        return wrapped

    def __enter__(self) -> "Instrument":
        from tide.layers.sampler import DeviceSample

        s, w, r = self.sched, self.worker, self.runner
        self._patch(s, "step", self._step)
        self._patch(s, "schedule", self._timed("schedule"))
        for name in ("prepare", "_prepare_successor"):
            self._patch(s, name, self._timed("batch_build"))
        self._patch(r, "_batch", self._timed("batch_build"))
        for name in ("forward_extend", "forward_decode"):
            self._patch(r, name, self._timed("launch"))
        self._patch(w, "sample", self._timed("sampling"))
        self._patch(w.sampler, "sample", self._timed("sampling"))
        for name in ("process_results", "_apply_launched"):
            self._patch(s, name, self._timed("output_processing"))
        for name in ("forward", "forward_launch"):
            self._patch(self.group, name, self._forward)
        self._patch(w, "_run_model", self._run_model)
        self._to_output = DeviceSample.to_output
        DeviceSample.to_output = self._timed("token_sync")(DeviceSample.to_output)  # type: ignore
        return self

    def __exit__(self, *exc: Any) -> None:
        from tide.layers.sampler import DeviceSample

        DeviceSample.to_output = self._to_output  # type: ignore[method-assign]
        for obj, name, saved in reversed(self._patched):
            if saved is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, saved)

    # ---- results
    def summary(self, wall: float) -> dict[str, Any]:
        if self.cuda:
            torch.cuda.synchronize()
        steps = [s for s in self.steps if s.kind != "none" or sum(s.host.values()) > 0]
        kinds = ("prefill", "mixed", "decode")
        device: dict[str, Any] = {k: {"steps": 0, "forward_s": 0.0, "sampling_s": 0.0} for k in kinds}
        gaps: list[float] = []
        by_transition: dict[str, float] = defaultdict(float)
        prev_end = None
        prev_kind = ""
        busy = 0.0
        for s in steps:
            if s.kind == "none":
                continue
            if s.events is not None:
                a, m, b = s.events
                fwd, smp = a.elapsed_time(m) / 1e3, m.elapsed_time(b) / 1e3
                if prev_end is not None:
                    gaps.append(max(0.0, prev_end.elapsed_time(a) / 1e3))
                    by_transition[f"{prev_kind} -> {s.kind}"] += gaps[-1]
                prev_end = b
                prev_kind = s.kind
            elif s.device_s is not None:
                fwd, smp = s.device_s
            else:
                continue
            d = device[s.kind]
            d["steps"] += 1
            d["forward_s"] += fwd
            d["sampling_s"] += smp
            busy += fwd + smp
        host_gaps = [b.start - a.end for a, b in zip(self.steps, self.steps[1:])]
        host: dict[str, Any] = {}
        for kind in ("all",) + kinds:
            sel = [s for s in self.steps if kind == "all" or s.kind == kind]
            if not sel:
                continue
            n = len(sel)
            per = {sec: 1e3 * sum(s.host.get(sec, 0.0) for s in sel) / n for sec in SECTIONS}
            per["step_total"] = 1e3 * sum(s.end - s.start for s in sel) / n
            host[kind] = {"steps": n, "ms_per_step": per}
        total_fwd = sum(device[k]["forward_s"] for k in kinds)
        return {
            "device_busy_fraction": busy / wall if wall else 0.0,
            "device_timing": "cuda_events" if self.cuda else "host_clock (CPU runs synchronously)",
            "forward_s": {k: device[k]["forward_s"] for k in kinds},
            "forward_share": {k: (device[k]["forward_s"] / total_fwd if total_fwd else 0.0)
                              for k in kinds},
            "sampling_s": sum(device[k]["sampling_s"] for k in kinds),
            "steps": {k: device[k]["steps"] for k in kinds},
            "device_idle_between_steps_s": sum(gaps),
            "device_idle_gap_ms_mean": 1e3 * sum(gaps) / len(gaps) if gaps else 0.0,
            "device_idle_by_transition_s": dict(by_transition),
            "host_between_steps_s": sum(host_gaps),
            "host_between_steps_ms_mean": 1e3 * sum(host_gaps) / len(host_gaps) if host_gaps else 0.0,
            "host": host,
        }


@contextlib.contextmanager
def _kernel_ranges(engine: Any) -> Iterator[None]:
    """Every model forward inside a `tide.<kind>` profiler range."""
    worker = getattr(engine.scheduler.worker, "local", engine.scheduler.worker)  # TP: rank 0's
    original = worker._run_model

    def wrapped(batch: Any) -> Any:
        with torch.profiler.record_function(f"tide.{batch_kind(batch)}"):
            return original(batch)

    worker._run_model = wrapped
    try:
        yield
    finally:
        del worker._run_model


STEP_KINDS = ("prefill", "mixed", "decode")


def attribute_kernels(trace: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Device seconds per step kind and kernel class from a Chrome trace of the profiler: each
    kernel belongs to the `tide.<kind>` range (on the launching thread) that encloses the host call
    that launched it (matched by correlation id; a graph replay's kernels share its launch's id), so
    kernels of replayed graphs and of forwards launched ahead by the overlap schedule count too."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges: dict[Any, list[tuple[float, float, str]]] = {}
    launches: dict[int, tuple[Any, float]] = {}
    for e in events:
        name, cat = e.get("name", ""), e.get("cat", "")
        if name.startswith("tide.") and name[5:] in STEP_KINDS:
            ranges.setdefault(e.get("tid"), []).append((e["ts"], e["ts"] + e.get("dur", 0), name[5:]))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (e.get("tid"), e["ts"])
    out = {k: dict.fromkeys(KERNEL_CLASSES, 0.0) for k in STEP_KINDS}
    for e in events:
        if e.get("cat") != "kernel":
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is None:
            continue
        tid, ts = launch
        for start, end, kind in ranges.get(tid, []):
            if start <= ts <= end:
                out[kind][kernel_class(e.get("name", ""))] += e.get("dur", 0) / 1e6
                break
    return out


def kernel_breakdown(engine: Any, reqs: list[tuple[list[int], int]],
                     sampling: Sampling | None = None) -> dict[str, Any]:
    """Attention / GEMM / other time within prefill, mixed and decode forwards (a profiled run):
    device kernels on CUDA, operators' self CPU time elsewhere."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.scheduler.worker.model_runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    engine.flush_cache()
    with _kernel_ranges(engine), profile(activities=activities) as prof:
        _generate(engine, reqs, sampling)
        if cuda:
            torch.cuda.synchronize()
    out: dict[str, dict[str, float]] = {k: dict.fromkeys(KERNEL_CLASSES, 0.0)
                                        for k in STEP_KINDS}

    def range_of(evt: Any) -> str | None:
        while evt is not None:
            if evt.name.startswith("tide."):
                return evt.name[5:]
            evt = evt.cpu_parent
        return None

    if cuda:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                out = attribute_kernels(json.load(f))
    else:
        for evt in prof.events():
            if evt.name.startswith("tide."):
                continue
            kind = range_of(evt)
            if kind not in out:
                continue
            out[kind][kernel_class(evt.name)] += evt.self_cpu_time_total / 1e6
    result: dict[str, Any] = {"unit": "device kernel seconds" if cuda else "CPU operator seconds"}
    if cuda:  # every kernel of the run by class, whatever launched it (a check on the attribution)
        every = dict.fromkeys(KERNEL_CLASSES, 0.0)
        names: dict[str, float] = {}
        for avg in prof.key_averages():
            t = getattr(avg, "self_device_time_total", None)
            if t is None:
                t = getattr(avg, "self_cuda_time_total", 0.0)
            if t and not avg.key.startswith(("tide.", "aten::", "cuda")):
                every[kernel_class(avg.key)] += t / 1e6
                names[avg.key[:80]] = names.get(avg.key[:80], 0.0) + t / 1e6
        result["all_kernels"] = every
        # With PDL a kernel's time includes its wait on the one before: TIDE_PDL=0 for own times.
        result["top_kernels_s"] = dict(sorted(names.items(), key=lambda kv: -kv[1])[:16])
    for kind, classes in out.items():
        total = sum(classes.values())
        if total:
            result[kind] = {**classes, "total": total,
                            **{f"{c}_share": classes[c] / total for c in KERNEL_CLASSES}}
    return result


@dataclass(frozen=True)
class Sampling:
    """How the workload samples: greedy by default; temperature 1 with logprobs is an RL rollout."""

    temperature: float = 0.0
    return_logprob: bool = False


def _generate(engine: Any, reqs: list[tuple[list[int], int]],
              sampling: Sampling | None = None) -> list[dict]:
    s = sampling or Sampling()
    ids = [r[0] for r in reqs]
    params = [{"max_new_tokens": o, "temperature": s.temperature, "ignore_eos": True}
              for _, o in reqs]
    return engine.generate(input_ids=ids, sampling_params=params, return_logprob=s.return_logprob)


def profile_throughput(shape: str, num_requests: int, lo: int, hi: int, kernels: bool,
                       kernel_requests: int | None, options: dict[str, Any],
                       sampling: Sampling | None = None) -> dict[str, Any]:
    import tide

    if shape == "demo":
        engine = tide.Engine(**options)
    else:
        from benchmarks.run import make_engine

        engine = make_engine(shape, **options)
    try:
        sched = engine.scheduler
        vocab = sched.model_config.vocab_size if sched.model_config is not None else 32000
        reqs = workload(num_requests, lo, hi, vocab=min(vocab, 100000)) if vocab > 1000 else []
        if vocab <= 1000:  # a tiny test vocabulary: same lengths, ids inside it
            reqs = [([2 + (i * 7919 + j) % (vocab - 2) for j in range(len(p))], o)
                    for i, (p, o) in enumerate(workload(num_requests, lo, hi))]
        cuda = engine.scheduler.worker.model_runner.device.type == "cuda"
        _generate(engine, reqs[:4], sampling)  # warm-up
        engine.flush_cache()
        stats0 = dict(vars(sched.stats))
        if cuda:
            torch.cuda.synchronize()
        with Instrument(engine) as inst:
            t = time.perf_counter()
            outs = _generate(engine, reqs, sampling)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t
        out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        in_tokens = sum(len(p) for p, _ in reqs)
        res: dict[str, Any] = {
            "shape": shape,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            "engine_options": options,
            "overlap_schedule": sched.overlap,
            "mixed_chunk": sched.config.enable_mixed_chunk,
            "num_requests": num_requests,
            "lengths": [lo, hi],
            "sampling": vars(sampling or Sampling()),
            "wall_s": wall,
            "output_tokens": out_tokens,
            "input_tokens": in_tokens,
            "output_tok_s": out_tokens / wall,
            "total_tok_s": (in_tokens + out_tokens) / wall,
            "scheduler_stats": {k: v - stats0.get(k, 0) for k, v in vars(sched.stats).items()},
            **inst.summary(wall),
        }
        if kernels:
            try:
                res["kernels"] = kernel_breakdown(engine, reqs[:kernel_requests] if kernel_requests
                                                  else reqs, sampling)
            except Exception as e:  # noqa: BLE001 - the timing above stands on its own
                res["kernels"] = {"error": f"{type(e).__name__}: {e}"}
        return res
    finally:
        engine.shutdown()


def table(res: dict[str, Any]) -> str:
    lines = [f"# profile_throughput: {res['shape']} on {res['device']} ({res['date']}), "
             f"{res['num_requests']} requests, lengths {res['lengths']}, "
             f"overlap={res['overlap_schedule']}, mixed_chunk={res['mixed_chunk']}", ""]
    lines += ["| metric | value |", "| --- | ---: |",
              f"| wall | {res['wall_s']:.2f} s |",
              f"| output tok/s | {res['output_tok_s']:,.0f} |",
              f"| total tok/s | {res['total_tok_s']:,.0f} |",
              f"| device busy (forward + sampling ÷ wall) | {res['device_busy_fraction']:.1%} |",
              f"| device idle between steps | {res['device_idle_between_steps_s']:.2f} s "
              f"({res['device_idle_gap_ms_mean']:.3f} ms mean gap) |",
              "| device idle between steps, by the kinds of the steps on either side | "
              + ", ".join(f"{k} {v:.3f} s" for k, v in res["device_idle_by_transition_s"].items())
              + " |",
              f"| host between steps (caller's loop) | {res['host_between_steps_s']:.2f} s |",
              f"| sampling on device | {res['sampling_s']:.2f} s |"]
    stats = res["scheduler_stats"]
    lines.append(f"| steps prefill / mixed / decode (decode launched ahead) | "
                 f"{res['steps']['prefill']} / {res['steps']['mixed']} / {res['steps']['decode']} "
                 f"({stats.get('num_overlapped_decode', 0)}) |")
    for kind in ("prefill", "mixed", "decode"):
        if res["steps"][kind]:
            lines.append(f"| forward time, {kind} | {res['forward_s'][kind]:.2f} s "
                         f"({res['forward_share'][kind]:.1%}) |")
    kern = res.get("kernels")
    if kern:
        lines += ["", f"Within forwards ({kern.get('unit', '')}):", "",
                  "| step kind | attention | GEMM | communication | other | total |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        if "error" in kern:
            lines.append(f"| error: {kern['error']} | | | | | |")
        every = kern.get("all_kernels")
        if every:
            total = sum(every.values()) or 1.0
            lines.append("| whole run (any launcher) | " + " | ".join(
                f"{every[c]:.3f} s ({every[c] / total:.0%})" for c in KERNEL_CLASSES)
                + f" | {sum(every.values()):.3f} s |")
        for kind in ("prefill", "mixed", "decode"):
            k = kern.get(kind)
            if k:
                lines.append(f"| {kind} | " + " | ".join(
                    f"{k[c]:.3f} s ({k[c + '_share']:.0%})" for c in KERNEL_CLASSES)
                    + f" | {k['total']:.3f} s |")
    lines += ["", "Host time per scheduler step (ms, exclusive):", "",
              "| steps | n | " + " | ".join(SECTIONS) + " | step total |",
              "| --- | ---: |" + " ---: |" * (len(SECTIONS) + 1)]
    for kind, h in res["host"].items():
        per = h["ms_per_step"]
        lines.append(f"| {kind} | {h['steps']} | " + " | ".join(f"{per[s]:.3f}" for s in SECTIONS)
                     + f" | {per['step_total']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default=None,
                    help="llama-3.1-8b, qwen3-0.6b (benchmarks/shapes.py) or demo (the built-in model)")
    ap.add_argument("--quick", action="store_true",
                    help="demo model, 8 requests of 8-32 tokens (runs on CPU)")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--min-len", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--no-kernels", action="store_true", help="skip the profiled kernel pass")
    ap.add_argument("--kernel-requests", type=int, default=None)
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature instead of greedy")
    ap.add_argument("--logprobs", action="store_true", help="return every token's logprob")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    args = ap.parse_args(argv)
    shape = args.shape or ("demo" if args.quick else "llama-3.1-8b")
    n = args.num_requests or (8 if args.quick else 256)
    lo = args.min_len or (8 if args.quick else 100)
    hi = args.max_len or (32 if args.quick else 1024)
    res = profile_throughput(shape, n, lo, hi, not args.no_kernels, args.kernel_requests,
                             engine_options(args.engine), Sampling(args.temperature, args.logprobs))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile-{shape}.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(table(res), flush=True)
    return res


if __name__ == "__main__":
    main()
