"""Per-request sampling parameters (sglang's field names), validated on construction.

Ranges are those the sampler and the wire take: integer counts and token ids fit in 32 bits, a seed in
[0, 2**63 - 1], every float is finite (and stored as a float), and a temperature below
`GREEDY_TEMPERATURE` means greedy (dividing logits by 1e-300 overflows them to inf). Token ids and
`top_k` are checked against the model's vocabulary by `check_vocab`, which `Engine.generate` and the
server call.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tide.grammar import GRAMMAR_FIELDS, check_grammar

MAX_SEED = 2**63 - 1
MAX_INT32 = 2**31 - 1
GREEDY_TEMPERATURE = 1e-5
# Below this a repetition penalty divides logits toward overflow (1e-300 is 0 in fp32): NaN weights.
MIN_REPETITION_PENALTY = 0.01
# `logit_bias`: at most this many tokens, each biased by a value in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]
# (OpenAI's range: -100 bans a token, 100 all but forces it).
MAX_LOGIT_BIAS_TOKENS = 1024
# Stop strings and stop token ids a request may give (the server's own limits are lower): each
# stop string is searched for after every token.
MAX_STOP_STRINGS = 1024
MAX_STOP_TOKEN_IDS = 65536
LOGIT_BIAS_MAX = 100.0
# sglang's sampling fields for what tide does not do (structural tags, regex stops, custom logit
# processors): accepted when null, as its clients send them unused; else a ValueError naming them.
UNSUPPORTED_FIELDS = ("structural_tag", "stop_regex", "custom_params")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty")


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    `temperature` below `GREEDY_TEMPERATURE` (1e-5) means greedy and is stored as 0.
    `top_k == -1` disables top-k. Penalties follow the OpenAI
    definitions for `frequency_penalty`/`presence_penalty` (over generated tokens) and the HF definition
    for `repetition_penalty` (over prompt and generated tokens). `logit_bias` maps token ids
    (ints, or decimal strings as JSON carries them; stored as ints) to a value added to that token's
    logit before the penalties, as OpenAI's `logit_bias` does.

    `min_new_tokens` (at most `max_new_tokens`): until that many tokens are out, the tokens that
    would end the request (eos unless `ignore_eos`, and `stop_token_ids`) get no probability, and a
    stop string counts only where a later token completes it (vLLM's `min_tokens`): no stop ends
    the request before its min_new_tokens + 1-th token.

    A request that ends on a stop string or a stop token (eos included) leaves it out of its text
    (the token stays in the output ids); `no_stop_trim` keeps the text of every output token.
    `spaces_between_special_tokens` goes to the tokenizer's `decode` (transformers' argument;
    tokenizers backed by the `tokenizers` library put no spaces around special tokens either way).
    `sampling_seed` is sglang's name for `seed`: it is moved there on construction (giving both with
    different values is an error).

    Constrained decoding (`tide.grammar`): at most one of `json_schema` (a JSON schema, as JSON
    text), `regex` and `ebnf` holds the output to that grammar; the request ends on eos once the
    grammar is complete. It cannot be combined with `min_new_tokens`.
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
    logit_bias: dict[int, float] | None = None
    min_new_tokens: int = 0
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True
    sampling_seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop_strs: list[str] = field(init=False, repr=False, default_factory=list)
    # `stop_token_ids` as a set: a finished-check per token does not scan the list.
    stop_token_set: frozenset[int] = field(init=False, repr=False, default_factory=frozenset)

    def __post_init__(self) -> None:
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.sampling_seed is not None:
            _int_field("sampling_seed", self.sampling_seed, lo=0, hi=MAX_SEED)
            if self.seed is not None and self.seed != self.sampling_seed:
                raise ValueError(f"sampling_seed ({self.sampling_seed}) and seed ({self.seed}) "
                                 "name the same seed; give one")
            # `seed` is the one read from here on (copies of an n > 1 request change it alone).
            self.seed, self.sampling_seed = self.sampling_seed, None
        self.validate()
        for name in _FLOAT_FIELDS:  # ints are accepted; the sampler and the wire take floats
            setattr(self, name, float(getattr(self, name)))
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        if self.stop is None:
            self.stop_strs = []
        elif isinstance(self.stop, str):
            self.stop_strs = [self.stop]
        else:
            self.stop_strs = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop_token_set = frozenset(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Penalties: they read the tokens generated so far."""
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def constrained(self) -> bool:
        """Whether a grammar holds the output (`json_schema`, `regex` or `ebnf`)."""
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None

    @property
    def edits_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties, a logit bias or a grammar)."""
        return self.has_penalties or bool(self.logit_bias) or self.constrained

    def validate(self) -> None:
        _int_field("max_new_tokens", self.max_new_tokens, lo=0, hi=MAX_INT32)
        _int_field("min_new_tokens", self.min_new_tokens, lo=0, hi=MAX_INT32)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be at most max_new_tokens "
                             f"({self.max_new_tokens}), got {self.min_new_tokens}")
        _num_field("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _num_field("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _int_field("top_k", self.top_k, hi=MAX_INT32)
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
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 2], got "
                             f"{self.repetition_penalty}")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(
                isinstance(s, str) and s for s in stops
            ):
                raise ValueError("stop must be a non-empty string or a list of non-empty strings")
            if len(stops) > MAX_STOP_STRINGS:
                raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got "
                                 f"{len(stops)}")
            for s in stops:
                if not _is_unicode(s):
                    raise ValueError("stop must be valid Unicode (it holds a lone surrogate)")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT32
                for t in self.stop_token_ids
            ):
                raise ValueError(f"stop_token_ids must be a list of integers in [0, {MAX_INT32}]")
            if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got "
                                 f"{len(self.stop_token_ids)}")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.seed is not None:
            _int_field("seed", self.seed, lo=0, hi=MAX_SEED)
        _int_field("n", self.n, lo=1, hi=MAX_INT32)
        _logit_bias(self.logit_bias)
        grammars = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(grammars) > 1:
            raise ValueError(f"give at most one of json_schema, regex and ebnf, got {grammars}")
        if grammars:
            check_grammar(grammars[0], getattr(self, grammars[0]))
            if self.min_new_tokens > 0:
                raise ValueError(f"min_new_tokens cannot be combined with {grammars[0]} (the "
                                 "grammar decides where the output may end)")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError unless `top_k` and `stop_token_ids` fit a vocabulary of this size."""
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be -1 (disabled) or in [1, {vocab_size}] (the vocabulary "
                             f"size), got {self.top_k}")
        bad = next((t for t in self.stop_token_ids or () if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids holds {bad}, outside the vocabulary [0, {vocab_size})")
        bad = next((t for t in self.logit_bias or () if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias holds token {bad}, outside the vocabulary [0, "
                             f"{vocab_size})")

    def check_endings(self, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        """Raise ValueError when `min_new_tokens` would ban every token of the vocabulary (its
        stop token ids and, unless `ignore_eos`, the model's eos ids cover it): none could be
        sampled."""
        if self.min_new_tokens <= 0:
            return
        ending = set(self.stop_token_ids or ())
        if not self.ignore_eos:
            ending.update(eos_token_ids)
        if sum(1 for t in ending if 0 <= t < vocab_size) >= vocab_size:
            raise ValueError("min_new_tokens: every token of the vocabulary would end the request "
                             "(eos and stop_token_ids) before its minimum, so none could be sampled")

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> "SamplingParams":
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            # Rebuilt, so its fields are validated (and `stop_strs` derived) as they are now: an
            # instance may have been changed after construction. The caller's object is not used.
            params = {f.name: getattr(params, f.name) for f in dataclasses.fields(cls) if f.init}
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(params).__name__}")
        for name in UNSUPPORTED_FIELDS:
            if params.get(name) is not None:
                raise ValueError(f"{name} is not supported by tide (no structural tags, regex "
                                 "stops or custom logit processors); leave it out or null")
        params = {k: v for k, v in params.items() if k not in UNSUPPORTED_FIELDS}
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling_params field(s) {unknown}; allowed: {sorted(known)}")
        return cls(**params)


def _logit_bias(value: Any) -> dict[int, float] | None:
    """`logit_bias` checked (ValueError naming it) and normalised: int keys, float values."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got "
                         f"{type(value).__name__}")
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, got "
                         f"{len(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) <= 10:
            token = int(key)
        if (not isinstance(token, numbers.Integral) or isinstance(token, bool)
                or not 0 <= int(token) <= MAX_INT32):
            raise ValueError(f"logit_bias keys must be token ids in [0, {MAX_INT32}], got "
                             f"{_short(key)}")
        token = int(token)
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or not (
                -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX):  # type: ignore[operator]
            raise ValueError(f"logit_bias values must be numbers in [-{LOGIT_BIAS_MAX:g}, "
                             f"{LOGIT_BIAS_MAX:g}], got {_short(bias)} for token {token}")
        if token in out:
            raise ValueError(f"logit_bias names token {token} twice ({_short(key)})")
        out[token] = float(bias)
    return out


def _int_field(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _num_field(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {_short(value)}")


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
