"""Property-based fuzzing of every route the server publishes in `/openapi.json`.

schemathesis turns the served schema into hypothesis strategies: *positive* cases follow the schema
(valid shapes, extreme but allowed values), *negative* cases break it (wrong types, missing fields,
out-of-range numbers). Every case must get a non-5xx answer, and the server must stay live
(`/health` within 1 s) and leak nothing (no request left in flight) after the run. Admin calls that
change engine state are undone after each case (`continue_generation`), so later cases still run.
The figures are printed (`-s` shows them) and recorded in docs/reliability.md.
"""

from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from server_utils import running_server, serve_model_path

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402

USER_KEY, ADMIN_KEY = "fuzz-user", "fuzz-admin"
CASES_PER_MODE = 60          # per operation and generation mode
BUDGET_S = 150.0             # whole run; operations share it
# A positive init_weights_update_group case would wait for a trainer that never comes (up to its
# join timeout); its negative cases (every one a 400) are fuzzed, and tests/test_liveness.py covers
# the join itself.
POSITIVE_SKIP = {("POST", "/init_weights_update_group")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    roots = tmp_path_factory.mktemp("weight-root")
    model = serve_model_path(tmp_path_factory.mktemp("fuzz-model"))
    with running_server(model, "--api-key", USER_KEY, "--admin-api-key", ADMIN_KEY,
                        "--allowed-weight-roots", str(roots),
                        log_dir=tmp_path_factory.mktemp("fuzz-log"), api_key=ADMIN_KEY) as srv:
        yield srv


def _operations(schema_url: str, headers: dict[str, str]) -> list:
    schema = schemathesis.openapi.from_url(schema_url, headers=headers)
    return [result.ok() for result in schema.get_all_operations()]


def test_openapi_served_with_bodies(server) -> None:
    doc = server.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]
    schema = body["content"]["application/json"]["schema"]
    assert "prompt" in schema["properties"] and "model" in schema["required"]
    # nested models resolve inside the document
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    assert "ChatMessage" in doc["components"]["schemas"], list(doc["components"]["schemas"])
    assert "$ref" in str(chat)
    assert server.get("/").json()["openapi"] == "/openapi.json"
    assert server.get("/docs").status_code == 200


def test_fuzz_every_route(server) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    ops = _operations(server.url + "/openapi.json", headers)
    assert len(ops) >= 25, [op.label for op in ops]
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    deadline = time.monotonic() + BUDGET_S
    share = BUDGET_S / (2 * len(ops))

    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:

        def undo() -> None:
            r = http.post("/continue_generation", json={})
            assert r.status_code == 200, r.text

        def run(op, mode: GenerationMode) -> None:
            stop_at = min(deadline, time.monotonic() + share)

            @settings(max_examples=CASES_PER_MODE, deadline=None, database=None,
                      derandomize=True, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def one(case) -> None:
                if time.monotonic() > stop_at:
                    return
                resp = case.call(base_url=server.url, headers=headers, timeout=60)
                statuses[resp.status_code] += 1
                if resp.status_code >= 500:
                    failures.append(f"{case.method} {case.path} -> {resp.status_code}: "
                                    f"{resp.text[:300]}\n  {case.as_curl_command()[:500]}")
                if op.method.upper() == "POST" and op.path in ("/pause_generation",
                                                               "/release_memory_occupation"):
                    undo()

            try:
                one()
            except Unsatisfiable:
                pass

        for op in ops:
            key = (op.method.upper(), op.path)
            if key not in POSITIVE_SKIP:
                run(op, GenerationMode.POSITIVE)
            run(op, GenerationMode.NEGATIVE)

        cases = sum(statuses.values())
        fours = sum(n for s, n in statuses.items() if 400 <= s < 500)
        fives = sum(n for s, n in statuses.items() if s >= 500)
        print(f"\nfuzz: {len(ops)} operations, {cases} cases, 2xx "
              f"{sum(n for s, n in statuses.items() if s < 300)}, 4xx {fours}, 5xx {fives}; "
              f"statuses {dict(sorted(statuses.items()))}")
        assert not failures, "\n".join(failures[:20])
        assert cases >= 10 * len(ops), statuses

        start = time.monotonic()
        assert http.get("/health").status_code == 200
        assert time.monotonic() - start < 1.0
        info = http.get("/get_server_info").json()
        assert info["num_http_requests_in_flight"] == 0, info
        assert info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0, info
        r = http.post("/generate", json={"text": "The for statement",
                                         "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text


def test_every_app_route_in_openapi(server) -> None:
    """Every route the app serves (FastAPI's own schema/docs pages aside) is in /openapi.json."""
    from fastapi.routing import APIRoute

    from tide.server.http_server import create_app
    from tide.server.metrics import ServerMetrics
    from tide.server.server_args import ServerArgs

    app = create_app(ServerArgs(), _NoTokenizerManager(), ServerMetrics("tide-test"))
    served = {(m, r.path_format) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}

    doc = server.get("/openapi.json").json()["paths"]
    published = {(m.upper(), p) for p, ops in doc.items() for m in ops}
    assert served and served <= published, sorted(served - published)


class _NoTokenizerManager:
    """Stands in for a TokenizerManager where only the route table is needed."""

    def __getattr__(self, name: str):
        raise AssertionError(f"route table construction touched tm.{name}")

