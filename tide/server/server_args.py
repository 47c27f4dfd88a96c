"""Options of `tide serve` that are about the HTTP server (the engine's are `EngineConfig`)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from tide.config import DEMO_MODEL_PATH, EngineConfig
from tide.server.function_call_parser import check_tool_call_parser
from tide.server.limits import RequestLimits
from tide.server.reasoning_parser import check_reasoning_parser
from tide.server.security import check_allowed_hosts, is_loopback_host

DEMO_MODEL_NAME = "tide-demo"
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerArgs:
    """HTTP options plus the engine configuration the scheduler process is built from.

    Bind policy: on a `host` that is not loopback, admin routes (weight updates, pause, memory
    release, ...) must sit behind `admin_api_key` unless `allow_unauthenticated_admin` says
    otherwise; construction raises ValueError before anything loads.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 30000
    # One user key, or several separated by commas (`--api-key` may also be given several times):
    # each key is its own identity, and client rids are scoped to it.
    api_key: str | None = None
    admin_api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    startup_timeout: float = 600.0
    # Directories `/update_weights_from_disk` may read from (default: the model's parent dir).
    allowed_weight_roots: tuple[str, ...] | None = None
    weight_version: str = "default"
    # Bounds on what one request may cost (body size, read time, prompt length, counts).
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Serve admin routes without an admin key on a non-loopback host (see the class docstring).
    allow_unauthenticated_admin: bool = False
    # `/generate` streams: each event carries what the sequence added since the last one (its new
    # text, output ids and logprobs), not all of it so far (sglang's option of the same name).
    incremental_streaming_output: bool = False
    # Liveness: /health is 503 and new requests are refused once the scheduler has neither stepped
    # nor answered for `scheduler_health_timeout` seconds (a declared long operation, such as a
    # weight update, counts as answering); in-flight requests are aborted after
    # `scheduler_abort_timeout` seconds of that.
    scheduler_health_timeout: float = 30.0
    scheduler_abort_timeout: float = 120.0
    # Data parallel: this many engine replicas (scheduler processes) behind one server, each
    # request on the least loaded one (`tide.cluster.dp_controller`).
    dp_size: int = 1
    # Chat completions: the format tool calls are parsed from (`function_call_parser`), and the
    # one thinking is separated by (`reasoning_parser`); None: the output is left as text.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # Host names (or IPs) a loopback-bound server answers besides localhost and loopback IPs: a
    # reverse proxy that forwards the client's `Host` (see `security.BrowserGuard`).
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.log_level.lower() not in _LOG_LEVELS:
            raise ValueError(f"log_level must be one of {_LOG_LEVELS}, got {self.log_level!r}")
        for name in ("api_key", "admin_api_key"):
            value = getattr(self, name)
            if value is not None and not value:
                raise ValueError(f"{name} must not be empty")
        if self.api_key is not None and any(not k.strip() for k in self.api_key.split(",")):
            raise ValueError("api_key: an empty key in the comma-separated list")
        if self.admin_api_key is not None and self.admin_api_key in self.api_keys:
            raise ValueError("admin_api_key must differ from every api_key")
        for name, low in (("scheduler_health_timeout", 0.5), ("scheduler_abort_timeout", 0.5),
                          ("startup_timeout", 1.0)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not low <= value <= 86400:
                raise ValueError(f"{name} must be in [{low}, 86400] seconds, got {value!r}")
        if self.scheduler_abort_timeout < self.scheduler_health_timeout:
            raise ValueError("scheduler_abort_timeout must be at least scheduler_health_timeout")
        if self.allowed_weight_roots is not None:
            if isinstance(self.allowed_weight_roots, str) or not self.allowed_weight_roots:
                raise ValueError("allowed_weight_roots must be a non-empty list of directories")
            for root in self.allowed_weight_roots:
                if not os.path.isdir(root):
                    raise ValueError(f"allowed_weight_roots: {root!r} is not a directory")
        if isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int) or not (
                1 <= self.dp_size <= 64):
            raise ValueError(f"dp_size must be an integer in [1, 64], got {self.dp_size!r}")
        object.__setattr__(self, "allowed_hosts", check_allowed_hosts(self.allowed_hosts))
        check_tool_call_parser(self.tool_call_parser)
        check_reasoning_parser(self.reasoning_parser)
        if not isinstance(self.weight_version, str) or not self.weight_version:
            raise ValueError("weight_version must be a non-empty string")
        for name in ("allow_unauthenticated_admin", "incremental_streaming_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.limits, RequestLimits):
            raise ValueError(f"limits must be a RequestLimits, got {type(self.limits).__name__}")
        if (not is_loopback_host(self.host) and self.admin_api_key is None
                and not self.allow_unauthenticated_admin):
            who = "anyone with the API key" if self.api_key else "anyone who can reach it"
            raise ValueError(
                f"--host {self.host} is not a loopback address and there is no --admin-api-key: "
                f"{who} could update weights, pause generation and release memory. Set "
                "--admin-api-key KEY, or pass --allow-unauthenticated-admin to serve the admin "
                "routes without one")

    def open_admin_warning(self) -> str | None:
        """The warning to log when admin routes need no key at all (None when they do)."""
        if self.api_key is not None or self.admin_api_key is not None:
            return None
        where = ("local users and processes" if is_loopback_host(self.host)
                 else f"everyone who can reach {self.host}")
        return ("no --api-key or --admin-api-key: every route, admin routes included (weight "
                f"updates, pause/continue, memory release), is open to {where}")

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The user keys (none: the user routes are open, and every caller is one identity)."""
        if self.api_key is None:
            return ()
        return tuple(dict.fromkeys(key.strip() for key in self.api_key.split(",")))

    @property
    def weight_roots(self) -> list[str]:
        """The resolved directories `/update_weights_from_disk` may read under."""
        roots = self.allowed_weight_roots
        if roots is None:
            roots = (os.path.dirname(os.path.realpath(self.engine.model_path)),)
        return list(dict.fromkeys(os.path.realpath(r) for r in roots))

    @property
    def model_names(self) -> list[str]:
        """Names a request's `model` may use: the served name first, then the model path."""
        names: list[str] = []
        if self.served_model_name:
            names.append(self.served_model_name)
        if os.path.abspath(self.engine.model_path) == os.path.abspath(DEMO_MODEL_PATH):
            names.append(DEMO_MODEL_NAME)
        names.append(self.engine.model_path)
        return list(dict.fromkeys(names))

    def public_dict(self) -> dict[str, Any]:
        """Everything but the secrets, for `/get_server_info`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("engine", "limits")}
        out["limits"] = dataclasses.asdict(self.limits)
        out["api_key"] = "***" if self.api_key else None
        out["admin_api_key"] = "***" if self.admin_api_key else None
        out["allowed_weight_roots"] = self.weight_roots
        out.update(dataclasses.asdict(self.engine))
        return out
