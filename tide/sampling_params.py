"""Per-request sampling parameters (sglang's field names), validated on construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

_MAX_SEED = 2**63 - 1


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    `temperature == 0` means greedy. `top_k == -1` disables top-k. Penalties follow the OpenAI
    definitions for `frequency_penalty`/`presence_penalty` (over generated tokens) and the HF definition
    for `repetition_penalty` (over prompt and generated tokens).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1
    stop_strs: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self.validate()
        if self.stop is None:
            self.stop_strs = []
        elif isinstance(self.stop, str):
            self.stop_strs = [self.stop]
        else:
            self.stop_strs = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        _int_field("max_new_tokens", self.max_new_tokens, lo=0)
        _num_field("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _num_field("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _int_field("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        _num_field("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _num_field(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _num_field("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(
                isinstance(s, str) and s for s in stops
            ):
                raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids
            ):
                raise ValueError("stop_token_ids must be a list of non-negative integers")
        if self.seed is not None:
            _int_field("seed", self.seed, lo=0)
            if self.seed > _MAX_SEED:
                raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        _int_field("n", self.n, lo=1)

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> "SamplingParams":
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(params).__name__}")
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling_params field(s) {unknown}; allowed: {sorted(known)}")
        return cls(**params)


def _int_field(name: str, value: Any, lo: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")


def _num_field(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
