"""Engine configuration: one frozen, validated dataclass.

`EngineConfig.from_kwargs` rejects unknown keys with a `ValueError` naming them, so a typo in an option
never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEMO_MODEL_PATH = str(Path(__file__).parent / "demo_model")

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass(frozen=True)
class EngineConfig:
    """Options of an engine. Field names follow sglang's `ServerArgs` where sglang has the concept."""

    model_path: str = DEMO_MODEL_PATH
    tokenizer_path: str | None = None
    # No tokenizer at all: requests are token ids in, token ids out (text inputs and stop strings
    # are refused). The checkpoint needs no tokenizer files.
    skip_tokenizer_init: bool = False
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    context_length: int | None = None
    attention_backend: str = "auto"  # "auto": triton on CUDA, torch_native elsewhere
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256
    # Memory pools.
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None
    max_running_requests: int = 256
    # Scheduling.
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    disable_radix_cache: bool = False
    # Releasing memory to a colocated trainer (release/resume_memory_occupation).
    enable_memory_saver: bool = False
    enable_cpu_backup: bool = False
    schedule_conservativeness: float = 1.0
    # RL fidelity: every op whose reduction order could depend on the batch runs batch-invariant,
    # so a request's tokens and logprobs do not depend on what shares its batch, on chunked
    # prefill or on a cached prefix (see docs/rl.md). CPU only for now.
    enable_deterministic_inference: bool = False
    # Loading.
    show_progress: bool | None = None
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.load_format != "dummy" and not os.path.isdir(self.model_path):
            raise ValueError(f"model_path must be a model directory, got {self.model_path!r}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        _positive("max_total_tokens", self.max_total_tokens, allow_none=True)
        _positive("context_length", self.context_length, allow_none=True)
        _positive("max_running_requests", self.max_running_requests)
        _positive("cuda_graph_max_bs", self.cuda_graph_max_bs)
        _positive("chunked_prefill_size", self.chunked_prefill_size)
        _positive("max_prefill_tokens", self.max_prefill_tokens)
        if self.schedule_conservativeness <= 0:
            raise ValueError(
                f"schedule_conservativeness must be > 0, got {self.schedule_conservativeness}"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown engine option(s) {unknown}; allowed options are {sorted(known)}"
            )
        if kwargs.get("model_path") is None:
            kwargs.pop("model_path", None)
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def _positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
