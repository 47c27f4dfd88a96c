"""Request bodies of the HTTP routes (OpenAI and sglang-native), validated strictly.

Models forbid unknown fields and do not coerce types (`"0.5"` is not a number), so a typo or a wrong
type is a 400 naming the field instead of being silently ignored. Ranges are checked here too where
they belong to the protocol (OpenAI's `temperature` in [0, 2], ...); the server's own bounds (`n`,
`logprobs`, stop lists, batch sizes, ...) are `RequestLimits`, checked by the routes; `SamplingParams`
re-validates what reaches the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model

from tide.io_struct import UNUSED_ARGS, WeightUpdateOptions, check_weight_version, unsupported
from tide.sampling_params import MIN_REPETITION_PENALTY
from tide.weights.distributed import (
    DEFAULT_JOIN_TIMEOUT_S,
    MAX_GROUP_NAME_LEN,
    MAX_JOIN_TIMEOUT_S,
    MAX_WORLD_SIZE,
    check_group_name,
    check_master_address,
)

_STRICT = ConfigDict(extra="forbid", strict=True)

TokenIds = list[int]
# A weight-update group's name: 1 to 128 of [A-Za-z0-9_.-].
GroupName = Annotated[str, Field(min_length=1, max_length=MAX_GROUP_NAME_LEN),
                      AfterValidator(check_group_name)]
StopType = str | list[str] | None
MAX_RID_CHARS = 256


def _check_rid_value(value: str, where: str = "") -> str:
    if len(value) > MAX_RID_CHARS:
        raise ValueError(f"a request id{where} may have at most {MAX_RID_CHARS} characters, got "
                         f"{len(value)}")
    if not value.isprintable():
        raise ValueError(f"a request id{where} may hold printable characters only (no control "
                         "characters)")
    return value


def check_rid(value: str) -> str:
    """A client's request id: at most `MAX_RID_CHARS` printable characters (it is logged and
    echoed: no newline or other control character)."""
    return _check_rid_value(value)


def check_rids(value: str | list[str] | None) -> str | list[str] | None:
    """`check_rid` of one id or of each of a list (the error names the index)."""
    if isinstance(value, list):
        for k, item in enumerate(value):
            _check_rid_value(item, f" (item {k})")
    elif value is not None:
        _check_rid_value(value)
    return value


# A client-chosen request id (`rid`).
Rid = Annotated[str, AfterValidator(check_rid)]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the output must follow."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON following a schema."""

    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _OpenAISampling(BaseModel):
    """Sampling fields shared by completions and chat completions (plus sglang's extensions)."""

    model_config = _STRICT

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stop: StopType = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # token id (as a decimal string, JSON's only key type) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    # sglang / vLLM extensions
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=2.0)
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(default=0, ge=0)  # at least this many tokens (min_new_tokens)
    no_stop_trim: bool = False  # keep a matched stop string / stop token in the text
    spaces_between_special_tokens: bool = True  # passed to the tokenizer's decode
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    rid: Rid | None = None
    # Constrained decoding: OpenAI's response_format, or sglang's fields (one of them at most)
    response_format: ResponseFormat | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class CompletionRequest(_OpenAISampling):
    """`POST /v1/completions`."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False


class TextContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


# OpenAI's rule for function names.
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    """One of a chat request's `tools`: a function the model may call."""

    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = _STRICT
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: ToolChoiceFunction


class FunctionCallMessage(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str


class ToolCallMessage(BaseModel):
    """A call an earlier assistant turn made (`messages[k].tool_calls`)."""

    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallMessage
    index: int | None = None  # a streamed call's, as a client that rebuilt it sends it back; unused


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    reasoning_content: str | None = None
    # What the openai client sends back with a reply it got (`messages.append(message)`); taken
    # and not rendered. A non-null `function_call` or `audio` is refused (not supported).
    refusal: str | None = None
    annotations: list[Any] | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None


class ChatCompletionRequest(_OpenAISampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # sglang: with --reasoning-parser, the thinking goes to `reasoning_content` (False: left in
    # `content`)
    separate_reasoning: bool = True


class ParseFunctionCallInput(BaseModel):
    """`POST /parse_function_call` (sglang's body): the tool calls `text` holds, in the format of
    `tool_call_parser` (default: the server's `--tool-call-parser`), among `tools`."""

    model_config = _STRICT
    text: str
    tools: list[ToolDefinition] = Field(default_factory=list)
    tool_call_parser: str | None = None


class SeparateReasoningInput(BaseModel):
    """`POST /separate_reasoning` (sglang's body): `text`'s thinking and answer, split by
    `reasoning_parser` (default: the server's `--reasoning-parser`)."""

    model_config = _STRICT
    text: str
    reasoning_parser: str | None = None


def _only(name: str, default: None | bool) -> Any:
    """A field tide does not implement: only `default` (null, or false) passes."""
    def check(value: Any) -> Any:
        if value is not default:
            raise ValueError(unsupported(name, default))
        return value
    return Annotated[Any, AfterValidator(check)]


def _unused_fields() -> type[BaseModel]:
    """sglang's `/generate` fields for what tide does not serve (`tide.io_struct.UNUSED_ARGS`):
    taken at the defaults its clients send, else a 400 naming the field. `log_metrics` (its
    per-request metrics switch) is taken and not used: tide's metrics count every request."""
    fields: dict[str, Any] = {
        name: (_only(name, default), Field(default=default, description=(
            f"sglang's; not supported by tide: only {'null' if default is None else 'false'}")))
        for name, default in UNUSED_ARGS.items()}
    fields["log_metrics"] = (bool, True)
    return create_model("_UnusedGenerateFields", __config__=_STRICT, **fields)


_UnusedGenerateFields = _unused_fields()


class GenerateReqInput(_UnusedGenerateFields):  # type: ignore[misc,valid-type]
    """`POST /generate` (sglang's body): one item or a batch, by text or by token ids."""

    model_config = _STRICT

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: Annotated[str | list[str] | None, AfterValidator(check_rids)] = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False


class AbortReqInput(BaseModel):
    """`POST /abort_request`."""

    model_config = _STRICT
    rid: Rid = ""
    abort_all: bool = False


class FlushCacheInput(BaseModel):
    """Optional body / query of `/flush_cache`: how long to wait for the engine to go idle."""

    model_config = ConfigDict(extra="forbid")
    timeout: float = Field(default=0.0, ge=0.0, le=3600.0)


# ---- admin: training <-> rollout handover (sglang's paths, bodies and defaults)
def _weight_version(value: str | None) -> str | None:
    return value if value is None else check_weight_version(value)


def _weight_update_flags() -> type[BaseModel]:
    """The body fields every weight update takes: `tide.io_struct.WeightUpdateOptions`'s fields,
    types and defaults (its one definition)."""
    fields: dict[str, Any] = {
        f.name: (f.type, f.default) for f in msgspec.structs.fields(WeightUpdateOptions)
    }
    fields["weight_version"] = (Annotated[str | None, AfterValidator(_weight_version)],
                                fields["weight_version"][1])
    return create_model("WeightUpdateFlags", __config__=_STRICT,
                        __doc__=WeightUpdateOptions.__doc__, **fields)


_WeightUpdateFlags = _weight_update_flags()


class UpdateWeightFromDiskInput(_WeightUpdateFlags):  # type: ignore[misc,valid-type]
    """`POST /update_weights_from_disk`: an HF safetensors directory under --allowed-weight-roots."""

    model_path: str = Field(min_length=1)
    load_format: Literal["auto", "safetensors"] | None = None


class UpdateWeightsFromTensorInput(_WeightUpdateFlags):  # type: ignore[misc,valid-type]
    """`POST /update_weights_from_tensor`: `tide.weights.serialize_named_tensors` output, as one
    string or (sglang's per-rank list) a list of one string per tensor-parallel rank; with
    `load_format="sharded"` each rank's payload holds only that rank's part of each tensor."""

    serialized_named_tensors: str | list[str]
    load_format: Literal["flattened_bucket", "sharded"] | None = None


class UpdateWeightsFromIPCInput(_WeightUpdateFlags):  # type: ignore[misc,valid-type]
    """`POST /update_weights_from_ipc`: serialized flattened buckets of CUDA IPC handles."""

    serialized_buckets: str | list[str]


class InitWeightsUpdateGroupInput(BaseModel):
    """`POST /init_weights_update_group`: join the trainer's group as rank `rank_offset`.

    `master_address`: a host name or an IP literal (IPv6 included), no port; `timeout` (seconds,
    default 120, at most 600) bounds the join: past it the request fails and nothing is kept."""

    model_config = _STRICT
    master_address: Annotated[str, Field(min_length=1, max_length=253),
                              AfterValidator(check_master_address)]
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, le=MAX_WORLD_SIZE - 1)
    world_size: int = Field(ge=2, le=MAX_WORLD_SIZE)
    group_name: GroupName = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout: float = Field(default=DEFAULT_JOIN_TIMEOUT_S, gt=0, le=MAX_JOIN_TIMEOUT_S)


class DestroyWeightsUpdateGroupInput(BaseModel):
    model_config = _STRICT
    group_name: GroupName = "weight_update_group"


class UpdateWeightsFromDistributedInput(_WeightUpdateFlags):  # type: ignore[misc,valid-type]
    """`POST /update_weights_from_distributed`: tensors rank 0 broadcasts, in `names` order."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str] = Field(min_length=1)
    shapes: list[list[int]] = Field(min_length=1)
    group_name: GroupName = "weight_update_group"
    load_format: Literal["flattened_bucket"] | None = None


class GetWeightsByNameInput(BaseModel):
    """`GET|POST /get_weights_by_name` (JSON body, or query parameters on GET)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    truncate_size: int = Field(default=100, ge=0, le=1 << 24)


class UpdateWeightVersionInput(BaseModel):
    model_config = _STRICT
    new_version: str = Field(min_length=1)
    abort_all_requests: bool = True


class PauseGenerationInput(BaseModel):
    model_config = _STRICT
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationInput(BaseModel):
    model_config = _STRICT
    torch_empty_cache: bool = True


class StartProfileInput(BaseModel):
    """`POST /start_profile` (sglang's body, less `output_dir`: a request never picks where the
    server writes; files go to `$TIDE_TORCH_PROFILER_DIR`, else /tmp/tide-profile-{uid})."""

    model_config = _STRICT
    num_steps: int | None = None
    activities: list[str] | None = None
    record_shapes: bool = False
    with_stack: bool = False
    profile_id: str = ""


class MemoryOccupationInput(BaseModel):
    """`POST /release_memory_occupation` and `/resume_memory_occupation` (sglang's body): `tags`
    among kv_cache, weights, cuda_graph; null (or no body) for all of them."""

    model_config = _STRICT
    tags: list[str] | None = None
