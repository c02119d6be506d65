"""OpenAI/vLLM request validation and response shapes (no I/O).

Turns a JSON body into a :class:`ParsedRequest` (token ids per prompt, limits, stream
options) or raises :class:`ApiError` with vLLM's error JSON; builds the response and
SSE chunk objects exactly as vLLM's OpenAI server lays them out.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from routerlab.sim import chat_template, tokenizer

DEFAULT_MAX_TOKENS = 16
# the response header with the monotonic time (seconds, this machine's clock) the server had the
# whole request (its body read): a client on the same machine tells the way to the replica, through
# Envoy and the router, from the time spent there
ARRIVED_HEADER = "x-sim-arrived"
MAX_TOKEN_ID = 2**31 - 1
# vLLM's defaults for VLLM_MAX_N_SEQUENCES and VLLM_MAX_COMPLETION_PROMPTS: they bound
# the fan-out of one request into engine sequences.
MAX_N = 16384
MAX_PROMPTS = 1024
_BAD_SALT_CHARS = ("@", "/", "\\", "\x00")


def sanitize_message(message: str) -> str:
    """vLLM 0.32's ``sanitize_message`` (``vllm/entrypoints/serve/exception_handling/utils.py``), run on
    every error message: memory addresses, traceback lines and file paths (under /home, /tmp, ...,
    or ending in a file extension) removed, the paths shown as ``<path>``."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, status: int = 400, type_: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type_
        self.param = param

    def body(self) -> bytes:
        """vLLM's ErrorResponse; the message scrubbed of file paths as vLLM 0.32 does."""
        return orjson.dumps(
            {"error": {"message": sanitize_message(self.message), "type": self.type, "param": self.param,
                       "code": self.status}}
        )


class PromptTokenizer(Protocol):
    """A real tokenizer (``--tokenizer``, :class:`routerlab.sim.hf_tokenizer.HfTokenizer`)."""

    def chat(self, body: dict[str, Any]) -> list[int]: ...

    def completion(self, body: dict[str, Any], prompt: str) -> list[int]: ...

    def check_ids(self, ids: list[int]) -> list[int]: ...

    def output_text(self, count: int, start: int = 0) -> str: ...


@dataclass
class ParsedRequest:
    """A validated chat or completions request, prompts already tokenised."""

    kind: str  # "chat" | "completion"
    model: str
    prompts: list[list[int]]
    n: int
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    cache_salt: str | None
    request_id: str
    created: int
    priority: int = 0  # vLLM's scheduling priority (lower first; read only with --scheduling-policy priority)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise ApiError("Request body must be a JSON object")
    return body


def request_kind(body: dict[str, Any]) -> str:
    """Which endpoint a SageMaker /invocations body is meant for."""
    if "messages" in body:
        return "chat"
    if "prompt" in body:
        return "completion"
    raise ApiError("/invocations body needs 'messages' (chat) or 'prompt' (completions)")


def _int_field(body: dict[str, Any], name: str, minimum: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(f"'{name}' must be an integer", param=name)
    if v < minimum:
        raise ApiError(f"{name} must be at least {minimum}, got {v}.", param=name)
    return v


def validate_cache_salt(salt: Any) -> str | None:
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ApiError("Parameter 'cache_salt' must be a non-empty string if provided.",
                       param="cache_salt")
    if len(salt) > 128:
        raise ApiError("Parameter 'cache_salt' must be at most 128 characters.", param="cache_salt")
    if any(c in salt for c in _BAD_SALT_CHARS):
        raise ApiError("Parameter 'cache_salt' must not contain '@', '/', '\\' or NUL.",
                       param="cache_salt")
    return salt


def _token_list(value: list[Any]) -> list[int]:
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise ApiError("Token ids must be integers in [0, 2**31).", param="prompt")
    return value


def completion_prompts(prompt: Any, tok: PromptTokenizer | None = None,
                       body: dict[str, Any] | None = None) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> token ids per prompt.

    With ``tok`` (a real tokenizer) strings are tokenised as vLLM does for ``body`` and token
    ids are checked against its vocabulary; else the stand-in tokenizer is used."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text) if tok is None else tok.completion(body or {}, text)

    def ids(value: list[Any]) -> list[int]:
        out = _token_list(value)
        return out if tok is None else tok.check_ids(out)

    if isinstance(prompt, str):
        return [encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [ids(prompt)]
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(f"prompt list length {len(prompt)} exceeds the maximum allowed count "
                           f"of {MAX_PROMPTS}.", param="prompt")
        if all(isinstance(p, str) for p in prompt):
            return [encode(p) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            return [ids(p) for p in prompt]
    raise ApiError(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of "
        "token id lists", param="prompt")


def parse(body: dict[str, Any], kind: str, served_model: str, max_model_len: int,
          tok: PromptTokenizer | None = None) -> ParsedRequest:
    """Validate like vLLM's OpenAI server; tokenise prompts with the sim tokenizer, or with
    ``tok`` (the model's real tokenizer and chat template) when given."""
    model = body.get("model")
    if model is None:
        raise ApiError("Field 'model' is required.", param="model")
    if model != served_model:
        raise ApiError(f"The model `{model}` does not exist.", status=404,
                       type_="NotFoundError", param="model")
    salt = validate_cache_salt(body.get("cache_salt"))
    if kind == "chat":
        if "messages" not in body:
            raise ApiError("Field 'messages' is required.", param="messages")
        if tok is not None:
            prompts = [tok.chat(body)]
        else:
            try:
                text = chat_template.render(
                    body["messages"],
                    tools=body.get("tools"),
                    add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                    continue_final_message=bool(body.get("continue_final_message", False)),
                )
            except chat_template.TemplateError as e:
                raise ApiError(str(e), param="messages") from None
            prompts = [tokenizer.encode(text)]
        max_tokens = _int_field(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens", 1)
        prefix = "chatcmpl-"
    else:
        if "prompt" not in body or body["prompt"] is None:
            raise ApiError("Field 'prompt' is required.", param="prompt")
        prompts = completion_prompts(body["prompt"], tok, body)
        max_tokens = _int_field(body, "max_tokens", 1)
        prefix = "cmpl-"
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    n = _int_field(body, "n", 1) or 1
    if n > MAX_N:
        raise ApiError(f"n must be at most {MAX_N}, got {n}.", param="n")
    if n * len(prompts) > MAX_N:  # the simulator's own bound on one request's fan-out
        raise ApiError(f"n x prompts must be at most {MAX_N}, got {n * len(prompts)}.",
                       param="n")
    min_tokens = _int_field(body, "min_tokens", 0) or 0
    if min_tokens > max_tokens:
        raise ApiError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                       f"got {min_tokens}.", param="min_tokens")
    for p in prompts:
        if not p:
            raise ApiError("The prompt cannot be empty.", param="prompt")
        if len(p) + max_tokens > max_model_len:
            raise ApiError(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"you requested {len(p) + max_tokens} tokens ({len(p)} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages "
                "or completion.", param="max_tokens" if len(p) < max_model_len else "prompt")
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError("'stream' must be a boolean", param="stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise ApiError("Stream options can only be defined when `stream=True`.",
                           param="stream_options")
        if not isinstance(opts, dict):
            raise ApiError("'stream_options' must be an object", param="stream_options")
    opts = opts or {}
    include_usage = bool(opts.get("include_usage", False))
    return ParsedRequest(
        kind=kind,
        model=model,
        prompts=prompts,
        n=n,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        # as vLLM's should_include_usage: per-chunk usage only together with include_usage
        continuous_usage=include_usage and bool(opts.get("continuous_usage_stats", False)),
        cache_salt=salt,
        request_id=prefix + uuid.uuid4().hex,
        created=int(time.time()),
    )


# ---- response shapes ---------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    """vLLM's usage object; ``cached_tokens=None`` leaves out ``prompt_tokens_details``
    (vLLM's per-chunk continuous usage has none)."""
    u: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def text_of(count: int, start: int = 0, tok: PromptTokenizer | None = None) -> str:
    """Text of generated tokens ``start .. count - 1`` (the stand-in's filler, or ``tok``'s)."""
    if tok is not None:
        return tok.output_text(count, start)
    return "".join(tokenizer.output_token(i)[1] for i in range(start, count))


def full_response(req: ParsedRequest, choices: list[tuple[int, str, str]],
                  use: dict[str, Any]) -> dict[str, Any]:
    """Non-streaming body; ``choices`` = (index, text, finish_reason)."""
    if req.kind == "chat":
        return {
            "id": req.request_id,
            "object": "chat.completion",
            "created": req.created,
            "model": req.model,
            "choices": [
                {"index": i, "message": {"role": "assistant", "content": text, "refusal": None,
                                         "annotations": None, "audio": None,
                                         "function_call": None, "tool_calls": [],
                                         "reasoning_content": None},
                 "logprobs": None, "finish_reason": fr, "stop_reason": None}
                for i, text, fr in choices
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": use,
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }
    return {
        "id": req.request_id,
        "object": "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": [
            {"index": i, "text": text, "logprobs": None, "finish_reason": fr,
             "stop_reason": None, "prompt_logprobs": None}
            for i, text, fr in choices
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": use,
        "kv_transfer_params": None,
    }


def chunk(req: ParsedRequest, choices: list[dict[str, Any]],
          use: dict[str, Any] | None = None) -> bytes:
    """One SSE event ``data: <json>\\n\\n``."""
    obj: dict[str, Any] = {
        "id": req.request_id,
        "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": choices,
    }
    if use is not None:
        obj["usage"] = use
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def role_choice(index: int) -> dict[str, Any]:
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}


def delta_choice(req: ParsedRequest, index: int, text: str, finish: str | None) -> dict[str, Any]:
    if req.kind == "chat":
        c: dict[str, Any] = {"index": index, "delta": {"content": text}, "logprobs": None,
                             "finish_reason": finish}
    else:
        c = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    if finish is not None or req.kind != "chat":
        c["stop_reason"] = None
    return c


DONE = b"data: [DONE]\n\n"
