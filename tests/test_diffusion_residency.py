"""Component residency on a CPU: placement per strategy, layerwise streaming bounds, release points
(observed through a fake device module and the engine's memory ledger), prefetch, OOM recovery,
and flat memory over many requests.

On a CPU the compute device and the host are the same memory, so "on the device" is read from the
tensors themselves: a component is on the host when every parameter's storage lies inside the
manager's host copy of it, and placed when none does (it then lives in a separate device buffer).
"""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

import tide
from tide.diffusion.residency import (
    LAYERWISE,
    OFFLOAD,
    RESIDENT,
    ComponentManager,
    ComponentPolicy,
    ComponentSize,
    find_blocks,
    plan_strategies,
    static_peak,
)
from tide.diffusion.stages import Stage, StageExecutor, StageHook
from tide.memory import MemoryLedger

ALL = ("text_encoder", "text_encoder_2", "transformer", "vae")
MI = ("text_encoder_2", "transformer")  # what FLUX.1's defaults would flag at real sizes


def spec(strategy: str, names=ALL) -> str:
    return ",".join(f"{n}={strategy}" for n in names)


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    from tide.diffusion.tiny import build_tiny_flux

    # 3 dual-stream + 4 single-stream blocks: enough for layerwise streaming to mean something.
    return build_tiny_flux(str(tmp_path_factory.mktemp("flux7") / "m"), seed=1, layers=3,
                           single_layers=4)


@pytest.fixture(scope="module")
def sdxl_dir(tmp_path_factory):
    from tide.diffusion.tiny import build_tiny_sdxl

    return build_tiny_sdxl(str(tmp_path_factory.mktemp("sdxl") / "m"), seed=2)


class FakeDevice:
    """A device module whose `empty_cache` records the stage running when it was called."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[str | None] = []
        self.snapshots: list[dict[str, bool]] = []

    def is_available(self) -> bool:
        return True

    def empty_cache(self) -> None:
        self.calls.append(self.engine.pipeline.executor.current_stage)
        self.snapshots.append({n: c.on_device for n, c in self.engine.residency.components.items()})

    def memory_reserved(self) -> int:
        return 0

    def memory_allocated(self) -> int:
        return 0


def make(path, fake=True, **kw):
    engine = tide.DiffusionEngine(path, **kw)
    device = None
    if fake:
        device = FakeDevice(engine)
        engine.residency.device_module = device
    return engine, device


def gen(engine, seed=0, prompt="a red fox", **kw):
    out = engine.generate(prompt, seed=seed, num_inference_steps=2, height=32, width=32,
                          output_type="np", **kw)
    return out["images"][0], out["meta_info"]


def host_ranges(manager, name):
    comp = manager.components[name]
    groups = [*comp.groups(), *([comp.backup] if comp.backup else [])]
    return [(g.host.flat.data_ptr(), g.host.flat.data_ptr() + g.host.nbytes) for g in groups]


def in_host(t, ranges):
    return any(lo <= t.data_ptr() < hi for lo, hi in ranges)


def where(manager, name, module=None):
    """'host' (every tensor in the host copy), 'device' (none) or 'mixed'."""
    ranges = host_ranges(manager, name)
    module = module if module is not None else manager.components[name].module
    flags = {in_host(t, ranges) for t in [*module.parameters(), *module.buffers()]}
    return "host" if flags == {True} else "device" if flags == {False} else "mixed"


class Probe(StageHook):
    """Records, at each stage (after the manager placed it), where every component is."""

    def __init__(self, engine):
        self.engine = engine
        self.seen: list[tuple[str, str, dict[str, str]]] = []

    def _note(self, when, stage):
        m = self.engine.residency
        self.seen.append((when, stage.name, {n: where(m, n) if m.components[n].strategy != RESIDENT
                                             else "device" for n in m.components}))

    def before_stage(self, stage, batch):
        self._note("before", stage)

    def after_stage(self, stage, batch):
        self._note("after", stage)


# ---------------------------------------------------------------------------------------------------


def test_images_identical_under_every_strategy(flux_dir, sdxl_dir):
    for path, denoiser in ((flux_dir, "transformer"), (sdxl_dir, "unet")):
        names = ("text_encoder", "text_encoder_2", denoiser, "vae")
        resident = make(path, fake=False)[0]
        ref, _ = gen(resident, seed=7)
        budget = sum(i.num_bytes for i in resident.pipeline.component_infos) * 0.75 / 1e9
        variants = [
            {"component_residency": spec(OFFLOAD, names)},
            {"component_residency": spec(LAYERWISE, names)},
            {"component_residency": spec(LAYERWISE, names), "layerwise_blocks": 1},
            {"component_residency": f"text_encoder_2=offload,{denoiser}=layerwise",
             "layerwise_blocks": 3},
            {"component_residency": f"{denoiser}=offload,vae=offload",
             "preferred_resident": (denoiser,)},
            {"component_residency": "auto", "residency_budget_gb": budget},
        ]
        for kw in variants:
            engine, _ = make(path, fake=False, **kw)
            img, meta = gen(engine, seed=7)
            assert np.array_equal(img, ref), (path, kw)
            img2, _ = gen(engine, seed=7)  # and again, after a first full cycle of moves
            assert np.array_equal(img2, ref), (path, kw)
        auto = make(path, fake=False, component_residency="auto", residency_budget_gb=budget)[0]
        assert set(auto.pipeline.strategies.values()) != {RESIDENT}  # the budget forced moves


def test_stage_sees_its_components_placed_and_offloaded_ones_return_to_host(flux_dir):
    engine, _ = make(flux_dir, component_residency=spec(OFFLOAD), memory_intensive=MI)
    probe = Probe(engine)
    engine.pipeline.executor.add_hook(probe)
    gen(engine)
    stage_components = {s.name: set(s.components) for s in engine.pipeline.stages}
    for when, stage, places in probe.seen:
        for name in stage_components[stage]:
            assert places[name] == "device", (when, stage, name)
        if when == "before" and stage == "timestep_preparation":
            assert places["text_encoder"] == "host"  # back after text_encoding
            assert places["text_encoder_2"] == "host"
    for name in ALL:  # after the request: everything back on the host
        assert where(engine.residency, name) == "host"
        assert not engine.residency.components[name].on_device
    assert engine.residency.device_bytes() == 0
    assert engine.residency.stats()["host_bytes"] >= sum(
        i.num_bytes for i in engine.pipeline.component_infos)


def test_layerwise_keeps_at_most_n_blocks_on_the_device(flux_dir):
    for n in (1, 2, 3):
        engine, _ = make(flux_dir, component_residency="transformer=layerwise,text_encoder_2=layerwise",
                         layerwise_blocks=n)
        manager = engine.residency
        seen = []
        for name in ("transformer", "text_encoder_2"):
            comp = manager.components[name]
            ranges = host_ranges(manager, name)
            blocks = [g.tensors for g in comp.blocks]

            def count(_module, _args, blocks=blocks, ranges=ranges, name=name, seen=seen):
                on_device = sum(1 for ts in blocks if not any(in_host(t, ranges) for t in ts))
                seen.append((name, on_device))

            for i, block in enumerate(find_blocks(comp.module)):
                def running(_m, _a, i=i, comp=comp, ranges=ranges):
                    # The block about to run is on the device (the manager's pre-hook ran first).
                    assert not any(in_host(t, ranges) for t in comp.blocks[i].tensors)

                block.register_forward_pre_hook(count)
                block.register_forward_pre_hook(running)
        gen(engine)
        assert seen and all(k <= n for _, k in seen), (n, max(k for _, k in seen))
        for name, blocks in (("transformer", 7), ("text_encoder_2", 2)):
            stats = manager.stats()["components"][name]
            assert stats["blocks"] == blocks
            assert stats["max_blocks_on_device"] == min(n, blocks)
            assert stats["blocks_on_device"] == 0 and not stats["on_device"]
        # The denoising stage's peak of placed weights: the resident components, the transformer's
        # rest and at most n of its blocks.
        size = manager.components["transformer"].size
        resident = sum(c.size.total for c in manager.components.values() if c.strategy == RESIDENT)
        peak = gen(engine)[1]["stage_memory"]["denoising"]["peak_bytes"] - resident
        assert peak <= size.rest + sum(sorted(size.blocks)[-n:]) + 4096 * (n + 1)  # + alignment
        assert peak < size.total


def test_cache_emptied_exactly_at_release_points(flux_dir):
    cases = {
        spec(RESIDENT): [],
        spec(OFFLOAD): [("text_encoding", "component_offload"), ("denoising", "component_offload")],
        "transformer=layerwise,text_encoder_2=offload,vae=offload":
            [("text_encoding", "component_offload"), ("denoising", "layerwise_pass")],
        # Not memory-intensive: moved, but never a release point.
        "text_encoder=offload,vae=offload": [],
    }
    for residency, expected in cases.items():
        engine, device = make(flux_dir, component_residency=residency, memory_intensive=MI)
        for _ in range(3):
            gen(engine)
        events = engine.memory_ledger.events
        assert [e.reason for e in events] == [r for _, r in expected] * 3, residency
        assert device.calls == [s for s, _ in expected] * 3, residency
        # Each release came after its memory-intensive component had left the device.
        for (stage, _), snap in zip(expected * 3, device.snapshots):
            gone = "text_encoder_2" if stage == "text_encoding" else "transformer"
            assert snap[gone] is False


def test_profiler_reports_every_stage_and_debug_log_changes_nothing(flux_dir, caplog):
    import logging

    engine, device = make(flux_dir, component_residency=spec(OFFLOAD), memory_intensive=MI)
    _, quiet = gen(engine)
    releases = len(engine.memory_ledger.events)
    with caplog.at_level(logging.DEBUG, logger="tide.diffusion.profiler"):
        _, loud = gen(engine)
    lines = [r.getMessage() for r in caplog.records if r.name == "tide.diffusion.profiler"]
    stages = [s.name for s in engine.pipeline.stages]
    assert [line.split(":")[0] for line in lines] == [f"stage {s}" for s in stages]
    assert list(quiet["stage_timings_ms"]) == stages == list(loud["stage_timings_ms"])
    assert quiet["stage_memory"] == loud["stage_memory"]  # placed weights: deterministic
    assert quiet["memory_source"] == "placed_weights"
    assert len(engine.memory_ledger.events) == 2 * releases  # logging adds no release
    sizes = {n: c.size.total for n, c in engine.residency.components.items()}
    mem = loud["stage_memory"]
    assert mem["denoising"]["peak_bytes"] >= sizes["transformer"]
    assert mem["decoding"]["allocated_bytes"] == 0  # the VAE left after its stage
    assert loud["peak_memory_bytes"] == max(m["peak_bytes"] for m in mem.values())
    assert loud["weight_version"] == "default"


def test_injected_oom_fails_one_request_then_the_next_succeeds(flux_dir):
    from tide.diffusion.io_struct import DiffusionOutOfMemoryError

    for residency in (spec(RESIDENT), spec(OFFLOAD), "transformer=layerwise"):
        engine, device = make(flux_dir, component_residency=residency, memory_intensive=MI)
        ref, _ = gen(engine, seed=3)
        armed = {"on": True}

        def boom(*_, armed=armed):
            if armed["on"]:
                armed["on"] = False
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

        handle = engine.pipeline.denoiser.register_forward_pre_hook(boom)
        before = engine.memory_ledger.totals()
        with pytest.raises(DiffusionOutOfMemoryError, match="stage 'denoising'.*out of memory"):
            gen(engine, seed=3)
        totals = engine.memory_ledger.totals()
        assert totals["oom"]["count"] == 1 and "oom" not in before
        assert device.calls[-1] == "denoising"
        for name, comp in engine.residency.components.items():
            if comp.strategy != RESIDENT:  # everything that could leave did
                assert not comp.on_device and comp.blocks_on_device() == 0, name
        img, _ = gen(engine, seed=3)
        handle.remove()
        assert np.array_equal(img, ref), residency
        assert engine.memory_ledger.totals()["oom"]["count"] == 1


def _settled_rss(process_rss) -> int:
    """Process RSS after collecting garbage and handing freed heap back to the OS, so that what other
    threads of the test process (earlier tests' servers and engines) left in malloc arenas does not
    read as growth; a leak still does."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return process_rss()


def test_fifty_requests_keep_memory_flat(flux_dir):
    from tide.memory.observe import process_rss

    for residency in (spec(RESIDENT), spec(OFFLOAD), "transformer=layerwise,text_encoder_2=offload"):
        engine, device = make(flux_dir, component_residency=residency, memory_intensive=MI)
        readings = []
        for i in range(50):
            gen(engine, seed=i)
            m = engine.residency
            readings.append((m.device_bytes(), m.host_bytes(), _settled_rss(process_rss)))
        (dev2, host2, rss2), (dev50, host50, rss50) = readings[1], readings[-1]
        assert dev50 == dev2 and host50 == host2, residency
        assert rss50 - rss2 < 0.02 * rss2, (residency, rss2, rss50)
        per_request = {spec(RESIDENT): 0}.get(residency, 2)
        assert len(engine.memory_ledger.events) == 50 * per_request
        # Never at a stage boundary that released nothing memory-intensive.
        assert set(device.calls) <= {"text_encoding", "denoising"}


def test_prefetch_takes_only_the_next_memory_intensive_component(flux_dir):
    engine, _ = make(flux_dir, component_residency=spec(OFFLOAD), memory_intensive=MI)
    probe = Probe(engine)
    engine.pipeline.executor.add_hook(probe)
    gen(engine)
    at = {(w, s): p for w, s, p in probe.seen}
    # During input validation: T5 (the next memory-intensive use) is on its way; CLIP is not.
    assert at[("before", "input_validation")]["text_encoder_2"] == "device"
    assert at[("before", "input_validation")]["text_encoder"] == "host"
    assert at[("before", "input_validation")]["transformer"] == "host"
    # During text encoding: the transformer is prefetched, the VAE (not memory-intensive) is not.
    assert at[("before", "text_encoding")]["transformer"] == "device"
    assert at[("before", "text_encoding")]["vae"] == "host"
    assert at[("before", "denoising")]["vae"] == "host"
    assert at[("before", "decoding")]["vae"] == "device"

    # A budget too small for T5 and the transformer together: the prefetch waits for T5 to leave.
    sizes = {n: c.size.total for n, c in engine.residency.components.items()}
    budget = sizes["text_encoder"] + sizes["text_encoder_2"] + sizes["transformer"] - 1
    tight, _ = make(flux_dir, component_residency=spec(OFFLOAD), memory_intensive=MI,
                    residency_budget_gb=budget / 1e9)
    probe = Probe(tight)
    tight.pipeline.executor.add_hook(probe)
    gen(tight)
    at = {(w, s): p for w, s, p in probe.seen}
    assert at[("before", "text_encoding")]["transformer"] == "host"
    assert at[("before", "timestep_preparation")]["transformer"] == "device"
    assert tight.residency.peak_device_bytes <= budget + 4096


def test_preferred_component_stays_after_a_request(flux_dir):
    engine, _ = make(flux_dir, component_residency="transformer=offload,text_encoder_2=offload",
                     preferred_resident=("transformer",), memory_intensive=MI)
    gen(engine)
    comps = engine.residency.components
    assert comps["transformer"].on_device and where(engine.residency, "transformer") == "device"
    assert not comps["text_encoder_2"].on_device
    gen(engine)
    gen(engine)
    assert comps["transformer"].placements == 1  # copied once, kept since
    assert comps["text_encoder_2"].placements == 3
    releases = [e.reason for e in engine.memory_ledger.events]
    assert releases == ["component_offload"] * 3  # T5 only

    # With a budget that cannot hold both, the preferred transformer makes room for T5.
    sizes = {n: c.size.total for n, c in comps.items()}
    budget = sizes["text_encoder"] + sizes["vae"] + sizes["transformer"] + 1024
    small, _ = make(flux_dir, component_residency="transformer=offload,text_encoder_2=offload",
                    preferred_resident=("transformer",), memory_intensive=MI,
                    residency_budget_gb=budget / 1e9)
    ref, _ = gen(engine, seed=5)
    img, _ = gen(small, seed=5)
    img2, _ = gen(small, seed=5)
    assert np.array_equal(img, ref) and np.array_equal(img2, ref)
    assert small.residency.components["transformer"].placements >= 2


def test_component_used_by_consecutive_stages_is_not_moved():
    """The manager alone, over synthetic stages: A and B run `m`, C runs nothing."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    calls = []

    def stage(name, comps):
        cls = type(f"S_{name}", (Stage,), {"name": name, "components": comps,
                                           "__call__": lambda self, batch: calls.append(
                                               (self.name, m[0].weight.data_ptr()))})
        return cls()

    stages = [stage("a", ("m",)), stage("b", ("m",)), stage("c", ())]
    ledger = MemoryLedger()
    fake = type("D", (), {"is_available": lambda self: True, "empty_cache": lambda self: None,
                          "memory_reserved": lambda self: 0, "memory_allocated": lambda self: 0})()
    manager = ComponentManager(torch.device("cpu"),
                               {"m": ComponentPolicy("m", OFFLOAD, memory_intensive=True)}, 2, None,
                               ledger, device_module=fake)
    manager.adopt("m", m)
    manager.bind(stages)
    executor = StageExecutor(stages, torch.device("cpu"), hooks=[manager])
    from tide.diffusion.io_struct import DiffusionBatch

    executor.run(DiffusionBatch(requests=[]))
    comp = manager.components["m"]
    assert comp.placements == 1 and not comp.on_device
    assert calls[0][1] == calls[1][1]  # the same device copy served a and b
    assert [e.reason for e in ledger.events] == ["component_offload"]


def test_auto_plan_fits_the_budget_in_the_documented_order():
    gb = 10**9
    sizes = {"text_encoder": ComponentSize(gb // 4),
             "text_encoder_2": ComponentSize(9 * gb, tuple([gb * 35 // 100] * 24)),
             "transformer": ComponentSize(24 * gb, tuple([gb // 2] * 40)),
             "vae": ComponentSize(gb // 5)}
    stages = [(), ("text_encoder", "text_encoder_2"), (), (), ("transformer",), ("vae",)]
    auto = dict.fromkeys(sizes, "auto")

    def plan(budget):
        return plan_strategies(auto, sizes, stages, "transformer", {"text_encoder_2", "transformer"},
                               budget, 2)

    assert set(plan(40 * gb).values()) == {RESIDENT}
    # T5 and the transformer cannot both stay: both swap, the small ones stay resident.
    assert plan(30 * gb) == {"text_encoder": RESIDENT, "text_encoder_2": OFFLOAD,
                             "transformer": OFFLOAD, "vae": RESIDENT}
    p = plan(12 * gb)
    assert p == {"text_encoder": RESIDENT, "text_encoder_2": OFFLOAD, "transformer": LAYERWISE,
                 "vae": RESIDENT}
    assert static_peak(p, sizes, stages, 2) <= 12 * gb < static_peak(
        {**p, "transformer": OFFLOAD}, sizes, stages, 2)
    p = plan(int(6.5 * gb))
    assert p["text_encoder_2"] == LAYERWISE and p["transformer"] == LAYERWISE
    with pytest.raises(ValueError, match="residency_budget_gb=0.5"):
        plan(gb // 2)
    fixed = {**auto, "transformer": "offload"}  # explicit strategies are kept
    assert plan_strategies(fixed, sizes, stages, "transformer", set(), 30 * gb, 2)["transformer"] \
        == OFFLOAD


@pytest.mark.parametrize("kwargs, message", [
    ({"component_residency": "transformer=fast"}, "component 'transformer' has unknown strategy 'fast'"),
    ({"component_residency": "transformer"}, "entry 'transformer' must be COMPONENT=STRATEGY"),
    ({"component_residency": "transformer=offload,transformer=resident"}, "given twice"),
    ({"component_residency": "unet=offload"}, "flux pipelines have no model component 'unet'"),
    ({"component_residency": "tokenizer=offload"}, "no model component 'tokenizer'"),
    ({"preferred_resident": ("vae2",)}, "preferred_resident: flux pipelines have no model component"),
    ({"component_residency": "transformer=layerwise", "preferred_resident": "transformer"},
     "preferred_resident: component 'transformer' is layerwise"),
    ({"layerwise_blocks": 0}, "layerwise_blocks must be a positive integer"),
    ({"residency_budget_gb": -1}, "residency_budget_gb must be a positive number"),
    ({"memory_intensive": "transformer,transformer"}, "memory_intensive: a component is named twice"),
])
def test_bad_residency_options_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        tide.DiffusionEngine("demo-diffusion", **kwargs)


def test_cli_rejects_a_bad_residency_spec(tmp_path):
    import subprocess
    import sys

    from server_utils import REPO

    proc = subprocess.run([sys.executable, "-m", "tide", "generate", "--model", "demo-diffusion",
                           "--out", str(tmp_path / "x.png"), "--component-residency",
                           "transformer=offlaod", "a fox"], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert "component 'transformer' has unknown strategy 'offlaod'" in proc.stderr


def test_layerwise_block_cache_fills_the_budget_and_streams_the_rest(flux_dir):
    """With a budget, the first blocks that fit stay on the device for the whole denoising stage:
    the later steps copy only the others; without one, every step streams every block."""
    ref, _ = gen(make(flux_dir, fake=False)[0], seed=4)
    plain, _ = make(flux_dir, component_residency="transformer=layerwise")
    gen(plain, seed=4)
    blocks = plain.residency.components["transformer"].blocks
    rest = plain.residency.components["transformer"].whole.nbytes
    resident = sum(c.size.total for c in plain.residency.components.values()
                   if c.strategy == RESIDENT)
    window = sum(sorted(g.nbytes for g in blocks)[-2:])
    steps = 2
    # The rest, every block each step, and the next step's first block prefetched at the last one.
    assert plain.residency.components["transformer"].placements == 1 + steps * len(blocks) + 1
    # Room for the three largest (first) blocks beside the window.
    budget = resident + rest + window + sum(g.nbytes for g in blocks[:3]) + 64
    engine, _ = make(flux_dir, component_residency="transformer=layerwise",
                     residency_budget_gb=budget / 1e9)
    img, meta = gen(engine, seed=4)
    assert np.array_equal(img, ref)
    comp = engine.residency.components["transformer"]
    assert comp.placements == 1 + len(blocks) + (steps - 1) * (len(blocks) - 3) + 1
    assert comp.max_blocks_on_device <= 3 + 2
    assert not comp.on_device and comp.blocks_on_device() == 0 and not comp.cached
    assert meta["stage_memory"]["denoising"]["peak_bytes"] <= budget
