"""Request bodies of the HTTP routes (OpenAI and sglang-native), validated strictly.

Models forbid unknown fields and do not coerce types (`"0.5"` is not a number), so a typo or a wrong
type is a 400 naming the field instead of being silently ignored. Ranges are checked here too where
they belong to the protocol (OpenAI's `temperature` in [0, 2], ...); `SamplingParams` re-validates what
reaches the engine.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(extra="forbid", strict=True)

TokenIds = list[int]
StopType = Union[str, list[str], None]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAISampling(BaseModel):
    """Sampling fields shared by completions and chat completions (plus sglang's extensions)."""

    model_config = _STRICT

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=128)
    stop: StopType = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # sglang / vLLM extensions
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    rid: str | None = None


class CompletionRequest(_OpenAISampling):
    """`POST /v1/completions`."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class TextContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class GenerateReqInput(BaseModel):
    """`POST /generate` (sglang's body): one item or a batch, by text or by token ids."""

    model_config = _STRICT

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False


class AbortReqInput(BaseModel):
    """`POST /abort_request`."""

    model_config = _STRICT
    rid: str = ""
    abort_all: bool = False


class FlushCacheInput(BaseModel):
    """Optional body / query of `/flush_cache`: how long to wait for the engine to go idle."""

    model_config = ConfigDict(extra="forbid")
    timeout: float = Field(default=0.0, ge=0.0, le=3600.0)
