"""`python -m benchmarks.profile_throughput --quick` on CPU: the breakdown is complete and consistent,
and the instrumentation leaves the engine as it found it."""

from __future__ import annotations

import json

import pytest

import tide
from benchmarks import profile_throughput as pt


def test_quick_profile_reports_every_part(llama_path, tmp_path, capsys):
    res = pt.main(["--quick", "--num-requests", "4", "--min-len", "4", "--max-len", "12",
                   "--engine", f"model_path={llama_path}", "--engine", "chunked_prefill_size=16",
                   "--engine", "enable_mixed_chunk=true", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "profile-demo.json").read_text())
    assert saved["wall_s"] == pytest.approx(res["wall_s"])
    stats = res["scheduler_stats"]
    steps = res["steps"]
    # every forward the scheduler ran is one profiled step, by kind
    assert steps["prefill"] + steps["mixed"] == stats["num_forward_extend"] > 0
    assert steps["decode"] == stats["num_forward_decode"] > 0
    assert steps["mixed"] > 0 and stats["num_mixed_decode"] > 0  # chunks of 16 < 4 prompts
    assert res["output_tokens"] == stats["num_generated_tokens"]
    assert 0 < res["device_busy_fraction"] <= 1.0 + 1e-6
    assert sum(res["forward_share"].values()) == pytest.approx(1.0)
    # exclusive host sections add up to the step's time
    for kind, h in res["host"].items():
        per = h["ms_per_step"]
        assert sum(per[s] for s in pt.SECTIONS) == pytest.approx(per["step_total"], rel=1e-6), kind
        assert per["launch"] > 0 and per["batch_build"] > 0
    assert res["host"]["all"]["steps"] >= steps["prefill"] + steps["mixed"] + steps["decode"]
    kernels = res["kernels"]
    assert "error" not in kernels, kernels
    for kind in ("prefill", "decode"):
        assert kernels[kind]["gemm"] > 0 and kernels[kind]["attention"] > 0
        assert sum(kernels[kind][f"{c}_share"] for c in pt.KERNEL_CLASSES) == pytest.approx(1.0)
    out = capsys.readouterr().out
    assert "Host time per scheduler step" in out and "| decode |" in out


def test_kernel_names_are_classified():
    assert pt.kernel_class("_decode_stage1") == "attention"
    assert pt.kernel_class("_extend_kernel") == "attention"
    assert pt.kernel_class("aten::scaled_dot_product_attention") == "attention"
    assert pt.kernel_class("_gemv_kernel") == "gemm"
    assert pt.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert pt.kernel_class("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert pt.kernel_class("aten::addmm") == "gemm"
    assert pt.kernel_class("_rmsnorm_kernel") == "other"


def test_instrument_restores_the_engine(llama_path):
    engine = tide.Engine(str(llama_path))
    try:
        sched = engine.scheduler
        objs = (sched, sched.worker, sched.worker.sampler, sched.worker.model_runner)
        before = [set(vars(o)) for o in objs]
        with pt.Instrument(engine) as inst:
            engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 3})
        assert [s.kind for s in inst.steps if s.kind != "none"] == ["prefill", "decode", "decode"]
        assert [set(vars(o)) for o in objs] == before  # no wrapper left on an instance
        assert "step" not in vars(sched) and "forward" not in vars(sched.worker)
        from tide.layers.sampler import DeviceSample
        assert DeviceSample.to_output.__qualname__ == "DeviceSample.to_output"
    finally:
        engine.shutdown()


def test_kernels_are_attributed_to_the_step_that_launched_them():
    """From a Chrome trace: a kernel counts for the `tide.<kind>` range enclosing its launch on the
    launching thread (graph replays included), whenever the kernel itself ran; launches outside any
    range, and ranges of another thread, do not count."""
    def x(name, cat, ts, dur, tid=1, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}

    trace = {"traceEvents": [
        x("tide.prefill", "user_annotation", 0, 100),
        x("tide.decode", "user_annotation", 200, 50),
        x("tide.decode", "user_annotation", 0, 1000, tid=2),  # another thread's range
        x("cudaLaunchKernel", "cuda_runtime", 10, 1, correlation=1),
        x("cuLaunchKernelEx", "cuda_driver", 20, 1, correlation=2),
        x("cudaGraphLaunch", "cuda_runtime", 210, 2, correlation=3),
        x("cudaLaunchKernel", "cuda_runtime", 150, 1, correlation=4),  # between ranges
        x("nvjet_sm90_tst_256x128", "kernel", 30, 40, tid=7, correlation=1),
        x("_extend_kernel", "kernel", 80, 30, tid=7, correlation=2),  # runs past the range: counts
        x("_decode_stage1", "kernel", 400, 5, tid=7, correlation=3),  # graph kernels, run later
        x("_gemv_kernel", "kernel", 405, 7, tid=7, correlation=3),
        x("_one_shot_norm_kernel", "kernel", 412, 3, tid=7, correlation=3),  # a ranks' sum
        x("_rmsnorm_kernel", "kernel", 160, 9, tid=7, correlation=4),
    ]}
    out = pt.attribute_kernels(trace)
    assert out["prefill"] == {"attention": 30e-6, "gemm": 40e-6, "communication": 0.0, "other": 0.0}
    assert out["decode"] == {"attention": 5e-6, "gemm": 7e-6, "communication": 3e-6, "other": 0.0}
    assert out["mixed"] == dict.fromkeys(pt.KERNEL_CLASSES, 0.0)
