"""Helpers for the server tests: a model to serve, and `tide serve` as a real subprocess.

`serve_model_path(tmp_dir)` is the built-in demo model when it exists, else a tiny random Llama
checkpoint (conftest's `build_checkpoint`) given the demo model's chat template. `ServerProcess` starts
`python -m tide serve` on a free 127.0.0.1 port, waits for `/health`, and always kills its process
tree on `stop()`. `retry_slow_host` runs a scenario again when a stalled host broke its timing
premise (`SlowHost`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO / "tide" / "demo_model"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def serve_model_path(tmp_dir: Path) -> Path:
    """The model the server tests serve (the demo model if present)."""
    if (DEMO_MODEL / "config.json").is_file():
        return DEMO_MODEL
    path = tmp_dir / "serve-llama"
    if not (path / "config.json").is_file():
        sys.path.insert(0, str(REPO / "tests"))
        from conftest import build_checkpoint  # noqa: PLC0415
        from transformers import AutoTokenizer

        build_checkpoint(path, "llama")
        tok = AutoTokenizer.from_pretrained(path)
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(path)
    return path


T = TypeVar("T")


class SlowHost(Exception):
    """A scenario's timing premise did not hold: a request it meant to act on while running had
    already finished (a stream lasts about a second on a CPU; a loaded CI host can stall that long).
    Raised by the scenario once it has put the server back as it found it."""


def retry_slow_host(scenario: Callable[[], T], attempts: int = 4) -> T:
    """`scenario()`, run again each time it raises `SlowHost`. A scenario that fails its premise
    every time fails the test, so a server that never keeps a request running is still caught."""
    for attempt in range(attempts):
        try:
            return scenario()
        except SlowHost as e:
            if attempt == attempts - 1:
                raise AssertionError(f"timing premise failed {attempts} times: {e}") from e
    raise AssertionError("unreachable")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model: Path, *extra: str, log_dir: Path, api_key: str | None = None,
                   env: dict[str, str] | None = None) -> Iterator["ServerProcess"]:
    """A started, ready `ServerProcess`, stopped (process tree and all) on exit."""
    srv = ServerProcess(model, *extra, log_dir=log_dir, api_key=api_key, env=env)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


class ServerProcess:
    """`python -m tide serve ...` in its own process group, with its log in a file."""

    def __init__(self, model: Path, *extra: str, log_dir: Path, env: dict[str, str] | None = None,
                 api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_dir / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "tide", "serve", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(self.port), *extra]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                    "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        full_env.update(env or {})
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, start_new_session=True)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", headers=self.headers, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-20000:]

    def cpu_seconds(self) -> float:
        """CPU time the server's HTTP process has used (all its threads): a cost bound that a
        stalled host does not inflate, unlike wall-clock time."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def group_pids(self, settle: float = 30.0) -> list[str]:
        """Live processes left in the server's process group (waits up to `settle` seconds for
        helpers such as multiprocessing's resource tracker to exit), as "pid command" lines."""
        deadline = time.monotonic() + settle
        while True:
            out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(self.proc.pid)],
                                 capture_output=True, text=True).stdout
            live = [line.strip() for line in out.splitlines()
                    if line.split() and not line.split()[1].startswith("Z")]
            if not live or time.monotonic() > deadline:
                return live
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Signal the server, wait, then kill the whole process group whatever happened."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        return self.proc.returncode

    def get(self, path: str, **kw: Any) -> httpx.Response:
        kw.setdefault("headers", self.headers)
        return httpx.get(self.url + path, timeout=kw.pop("timeout", 60), **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        kw.setdefault("headers", self.headers)
        if body is not None:
            kw["content"] = json.dumps(body)
            kw["headers"] = {**kw["headers"], "Content-Type": "application/json"}
        return httpx.post(self.url + path, timeout=kw.pop("timeout", 60), **kw)


def assert_error(resp: httpx.Response, status: int, param: str | None = "__any__") -> dict:
    """The response is an OpenAI-style error with `status` (and `param`, unless "__any__")."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    return err


class _ShellCommand:
    """Unpickling this runs `command` in a shell (the attack a pickle-based payload allowed)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


def pickle_exploit_payload(marker: Path) -> str:
    """A base64 pickle, shaped like the old tensor payloads, that creates `marker` when loaded."""
    return base64.b64encode(pickle.dumps([("w", _ShellCommand(f"touch {marker}"))])).decode()


def assert_pickle_is_live(payload: str, marker: Path) -> None:
    """Prove the exploit works where pickle is run (a child process), then remove its marker."""
    code = "import base64, pickle, sys; pickle.loads(base64.b64decode(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, payload], check=True, timeout=60)
    assert marker.exists(), "the exploit payload did not run under plain pickle"
    marker.unlink()
