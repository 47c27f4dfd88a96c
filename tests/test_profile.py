"""`Engine.start_profile` / `stop_profile` (sglang's names): torch.profiler on every rank, one trace
and one operator summary per rank, stopped by hand or after `num_steps` forwards (CPU; at
tp_size 2 over gloo)."""

from __future__ import annotations

import json

import pytest
import tide

from conftest import build_checkpoint, random_prompts

OPTIONS = dict(device="cpu", dtype="float32", max_total_tokens=512, max_running_requests=4)
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PROMPTS = random_prompts(3, [7, 12])


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("profile") / "m", "llama")


def _check_rank_files(paths: list[str], rank: int) -> None:
    trace, summary = (p for p in paths if f"-TP-{rank}." in p)
    assert trace.endswith(f"-TP-{rank}.trace.json") and summary.endswith(f"-TP-{rank}.kernels.json")
    with open(trace) as f:
        assert json.load(f)["traceEvents"], "an empty trace"
    with open(summary) as f:
        rows = json.load(f)
    assert rows["rank"] == rank
    counts = {r["name"]: r["count"] for r in rows["events"]}
    assert counts.get("aten::mm", 0) + counts.get("aten::addmm", 0) + counts.get(
        "aten::linear", 0) > 0, sorted(counts)[:20]


def test_profile_between_start_and_stop_writes_a_trace_and_a_summary(path, tmp_path):
    with tide.Engine(str(path), **OPTIONS) as engine:
        engine.start_profile(output_dir=str(tmp_path), profile_id="run1")
        with pytest.raises(RuntimeError, match="already running"):
            engine.start_profile(output_dir=str(tmp_path))
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        paths = engine.stop_profile()
        assert sorted(p.rsplit("/", 1)[1] for p in paths) == [
            "run1-TP-0.kernels.json", "run1-TP-0.trace.json"]
        _check_rank_files(paths, 0)
        with pytest.raises(RuntimeError, match="no profile is running"):
            engine.stop_profile()
        # The engine serves on, and a second profile may start.
        assert len(engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]) == 6
        engine.start_profile(output_dir=str(tmp_path), profile_id="run2", activities=["CPU"])
        assert len(engine.stop_profile()) == 2


def test_a_profile_with_num_steps_stops_by_itself(path, tmp_path):
    with tide.Engine(str(path), **OPTIONS) as engine:
        engine.start_profile(output_dir=str(tmp_path), num_steps=3, profile_id="steps")
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)  # more than 3 forwards
        assert (tmp_path / "steps-TP-0.trace.json").exists()
        _check_rank_files([str(tmp_path / "steps-TP-0.trace.json"),
                           str(tmp_path / "steps-TP-0.kernels.json")], 0)
        with pytest.raises(RuntimeError, match="no profile is running"):
            engine.stop_profile()


@pytest.mark.parametrize("bad,field", [
    (dict(activities=["TPU"]), "activities"),
    (dict(activities=[]), "activities"),
    (dict(num_steps=0), "num_steps"),
    (dict(num_steps=True), "num_steps"),
    (dict(num_steps=4097), "num_steps"),
    (dict(profile_id="../x"), "profile_id"),
])
def test_bad_profile_options_are_refused_by_name(path, tmp_path, bad, field):
    with tide.Engine(str(path), **OPTIONS) as engine:
        with pytest.raises(ValueError, match=field):
            engine.start_profile(output_dir=str(tmp_path), **bad)
        with pytest.raises(RuntimeError, match="no profile is running"):
            engine.stop_profile()


def test_a_directory_others_may_write_is_refused(path, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # another user could plant links to files a profile would overwrite
    with tide.Engine(str(path), **OPTIONS) as engine:
        with pytest.raises(RuntimeError, match="not be writable by others"):
            engine.start_profile(output_dir=str(shared))
        engine.start_profile(output_dir=str(tmp_path / "mine"), profile_id="ok")
        assert len(engine.stop_profile()) == 2
        assert (tmp_path / "mine").stat().st_mode & 0o777 == 0o700


def test_every_tensor_parallel_rank_writes_its_own_profile(path, tmp_path):
    with tide.Engine(str(path), tp_size=2, **OPTIONS) as engine:
        engine.start_profile(output_dir=str(tmp_path), profile_id="tp")
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        paths = engine.stop_profile()
        assert len(paths) == 4
        _check_rank_files(paths, 0)
        _check_rank_files(paths, 1)
        engine.start_profile(output_dir=str(tmp_path), profile_id="tp2")
        with pytest.raises(RuntimeError, match="already running"):
            engine.start_profile(output_dir=str(tmp_path), profile_id="tp3")
        assert len(engine.stop_profile()) == 4  # the failed start left the running one alone


def test_the_server_s_profile_routes(tmp_path_factory):
    """`POST /start_profile` and `/stop_profile` (admin routes): files in the server's profile
    directory, bad options a 400 naming the field, no path from the request."""
    from server_utils import running_server, serve_model_path

    def assert_error(resp, status, param="__any__"):
        assert resp.status_code == status, resp.text
        body = resp.json()
        assert body["success"] is False and body["error"]["message"], body
        if param != "__any__":
            assert body["error"]["param"] == param, body

    out = tmp_path_factory.mktemp("profiles")
    model = serve_model_path(tmp_path_factory.mktemp("serve-model"))
    with running_server(model, "--admin-api-key", "admin-p", api_key="admin-p",
                        log_dir=tmp_path_factory.mktemp("server-log"),
                        env={"TIDE_TORCH_PROFILER_DIR": str(out)}) as srv:
        assert_error(srv.post("/start_profile", {"num_steps": 0}), 400, "num_steps")
        assert_error(srv.post("/start_profile", {"activities": ["TPU"]}), 400, "activities")
        assert_error(srv.post("/start_profile", {"output_dir": "/etc"}), 400)  # not a field
        resp = srv.post("/start_profile", {"profile_id": "srv", "activities": ["CPU"]})
        assert resp.status_code == 200 and resp.json()["success"], resp.text
        assert_error(srv.post("/start_profile", {}), 400)  # one is running
        resp = srv.post("/generate", {"text": "The for statement",
                                      "sampling_params": {"max_new_tokens": 4}})
        assert resp.status_code == 200, resp.text
        resp = srv.post("/stop_profile")
        assert resp.status_code == 200, resp.text
        paths = resp.json()["paths"]
        assert sorted(p.rsplit("/", 1)[1] for p in paths) == [
            "srv-TP-0.kernels.json", "srv-TP-0.trace.json"]
        assert all((out / p.rsplit("/", 1)[1]).exists() for p in paths)
        assert_error(srv.post("/stop_profile"), 400)
