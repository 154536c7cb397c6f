"""Wire types: the OpenAI request subset disagg reads, and `disaggregated_params`.

A request body is decoded once into a plain dict (so every unknown field a client sends
reaches the worker unchanged) and validated by converting it to the typed view below.
Nothing here does I/O.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec

from disagg.errors import InvalidRequest

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]

RequestType = Literal["context_only", "generation_only", "context_and_generation"]


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class DisaggregatedParams(msgspec.Struct, omit_defaults=True):
    """TensorRT-LLM's field names, kept so real TensorRT-LLM workers can sit behind disagg."""

    request_type: RequestType = "context_and_generation"
    disagg_request_id: int | None = None
    ctx_request_id: int | None = None
    first_gen_tokens: list[int] | None = None
    first_gen_log_probs: list[Any] | None = None
    encoded_opaque_state: str | None = None
    draft_tokens: list[int] | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None
    schedule_style: str | None = None
    # generation_first: where the context worker pushes the KV (the waiting generation worker
    # and that leg's disagg_request_id); its answer says `kv_pushed` when it did
    gen_info_endpoint: str | None = None
    gen_request_id: int | None = None
    kv_pushed: bool | None = None
    conversation_id: str | None = None
    ctx_usage: dict[str, Any] | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: PosInt = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    logprobs: Any = None
    ignore_eos: bool = False  # vLLM / TensorRT-LLM extension
    disaggregated_params: DisaggregatedParams | None = None


# str, or a list of str / token ids / lists of token ids; the list form is checked by hand
# because msgspec unions take one array type only.
PromptType = str | list[Any]


class CompletionRequest(_Sampling, kw_only=True):
    prompt: PromptType
    max_tokens: NonNegInt | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prompt, list) and not _is_prompt_list(self.prompt):
            raise InvalidRequest(
                "`prompt` must be a string, a list of strings, a list of token ids or a list of"
                " lists of token ids.",
                param="prompt",
            )


def _is_prompt_list(items: list[Any]) -> bool:
    if not items:
        return False
    if all(isinstance(x, str) for x in items):
        return True
    if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in items):
        return True
    return all(
        isinstance(x, list) and x and _is_prompt_list(x) and isinstance(x[0], int) for x in items
    )


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: NonNegInt | None = None
    max_completion_tokens: NonNegInt | None = None
    prompt_token_ids: list[int] | None = None

    def token_budget(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: NonNegInt | None = None
    stream: bool = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    user: str | None = None
    prompt_token_ids: list[int] | None = None
    disaggregated_params: DisaggregatedParams | None = None


AnyRequest = CompletionRequest | ChatCompletionRequest | ResponsesRequest

_decoder = msgspec.json.Decoder()


def decode_body(body: bytes, *, msgpack: bool = False) -> dict[str, Any]:
    """Decode a JSON (or msgpack) body into a dict; anything but an object is a 400."""
    try:
        data = msgspec.msgpack.decode(body) if msgpack else _decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("Request body must be a JSON object.")
    return data


T = TypeVar("T")


def validate(data: dict[str, Any], kind: type[T]) -> T:
    """Convert a decoded body to its typed view; errors name the offending parameter."""
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = None
        if " - at `$." in text:
            text, _, where = text.partition(" - at `$.")
            param = where.rstrip("`")
        elif "missing required field" in text:
            param = text.rsplit("`", 2)[-2] if text.count("`") >= 2 else None
        raise InvalidRequest(
            f"Invalid request: {text}" + (f" (at `{param}`)" if param else ""),
            param=param.split("[")[0].split(".")[0] if param else None,
        ) from None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


encode_msgpack = msgspec.msgpack.Encoder().encode
encode_json = msgspec.json.Encoder().encode
