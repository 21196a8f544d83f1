"""An OpenAI batch input file to a Batchery job's input.

An OpenAI batch input file holds one request a line, ``{"custom_id", "method": "POST", "url", "body"}``,
each body a whole request to the batch's endpoint. A Batchery job runs one model with one set of params
over records ``{"custom_id", <input field>}``. `convert_requests` checks an uploaded file against the
batch's endpoint, splits each body into the model, the record's input and its params, and writes the
job's input. The first good line's params become the job's; a line whose params differ carries its own in
the record (``params``, with null for a field of the job's it leaves out), which the worker runs with. A
file whose lines disagree on the model (or on ``encoding_format``, which shapes the whole output file) is
refused, since a job runs one model. Each line's params are judged against the engine of the model it
names (`ParamsCheck`), so what the engine cannot honour is refused naming the line and the field.
An embeddings request's list of texts stays one record, embedded text by text on the worker. A Responses
API request (``/v1/responses``, text in and out) becomes a chat record: its ``input`` and ``instructions`` a
conversation, its ``max_output_tokens`` and ``text.format`` chat's ``max_tokens`` and ``response_format``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import orjson

from gpuworkers.engines.base import is_token_array
from gpuworkers.engines.media import MediaProblem, messages_media_problem
from portal.openai_api.formats.endpoints import EMBEDDING_ENCODINGS, RESPONSES, BatchEndpoint, endpoint_for
from tasks.shared.formats.records import input_problem

RESPONSES_PARAMS: Mapping[str, str] = {"max_output_tokens": "max_tokens", "text": "response_format"}
"""Responses API body fields and the engine params (chat's names) they become."""

SHOWN_STRING_CHARS = 60
"""Characters of a wrong string value quoted in a problem's message."""

DimensionsCheck = Callable[[str, Any], str | None]
"""``(model name, dimensions) -> problem``: what is wrong with a request's ``dimensions`` for the model the
catalog holds under that name, as the words after the field's name; None if nothing (or no such model,
which the submission refuses by itself)."""

ParamsCheck = Callable[[str, Mapping[str, Any]], tuple[str, str] | None]
"""``(model name, params) -> (field, message)``: the first of a request's params that the engine of the
model the catalog holds under that name cannot honour, the message starting with the field's name; None
if nothing (or no such model)."""

MediaCheck = Callable[[str, list[Any], str], MediaProblem | None]
"""``(model name, messages, field) -> problem``: the first content part of a chat request's messages that the
model the catalog holds under that name may not be given (`gpuworkers.engines.media`), its place named from
``field`` (``body.messages``); None if nothing (or no such model)."""

BaseModel = Callable[[str], str | None]
"""``(model name) -> name``: the catalog model a request naming that model runs on: the model itself, or the
base model of a LoRA adapter of that name the batch's tenant may use; None for a name the catalog does not
hold (the submission refuses it)."""

CALLER_FIELDS = frozenset({"user", "safety_identifier", "prompt_cache_key"})
"""Body fields that name the caller or a cache key: they change nothing a response holds, so they are
taken and not passed to the engine."""

BATCH_WIDE_FIELDS = frozenset({"encoding_format"})
"""Body fields every line must give alike: they shape the whole output file, not one response."""


@dataclass(frozen=True)
class RequestProblem:
    """One bad line of a batch input file (or the whole file, for ``empty_file``)."""

    line: int | None
    """1-based physical line number; None when the problem is the file as a whole."""
    code: str
    """What kind of problem, e.g. ``invalid_json``, ``mixed_models``."""
    message: str
    """What is wrong, for a person, naming the field."""
    param: str | None = None
    """The field at fault, e.g. ``body.model``, when there is one."""

    def __str__(self) -> str:
        return self.message if self.line is None else f"line {self.line}: {self.message}"


@dataclass
class RequestConversion:
    """The outcome of converting a batch input file: what the job runs, and what is wrong with the file."""

    model: str | None = None
    """The model every request names (None when no line was good)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The job's params: the first good line's body fields but the model and the input; other lines'
    records carry their own where they differ."""
    records: int = 0
    """Good lines, each written as a record."""
    problems: list[RequestProblem] = field(default_factory=list)
    """The first problems, in line order (at most ``max_problems``)."""
    problem_count: int = 0
    """All problems: bad lines, or one for an empty file."""

    @property
    def ok(self) -> bool:
        """The file can run: no problem at all (then it has at least one record)."""
        return self.problem_count == 0

    def _add(self, problem: RequestProblem, max_problems: int) -> None:
        self.problem_count += 1
        if len(self.problems) < max_problems:
            self.problems.append(problem)


def convert_requests(
    source: Iterable[bytes],
    target: BinaryIO,
    *,
    endpoint: str,
    max_problems: int = 20,
    max_line_bytes: int,
    dimensions_problem: DimensionsCheck | None = None,
    params_problem: ParamsCheck | None = None,
    base_model: BaseModel | None = None,
    media_problem: MediaCheck | None = None,
) -> RequestConversion:
    """Check an OpenAI batch input file and write its requests to ``target`` as Batchery records.

    ``source`` gives the file's bytes in order, as lines or as pieces of them: a piece without a newline
    is continued by the next, so ``iter(partial(stream.readline, max_line_bytes + 1), b"")`` keeps even
    an enormous line from being held whole; a line over ``max_line_bytes`` (newline excluded) is a
    problem. Blank lines are skipped, and still counted in line numbers. Memory is bounded apart from
    the custom_ids, kept to find duplicates.

    Good lines are written as they come, even when other lines are bad: the caller keeps ``target``
    only when the result is `RequestConversion.ok`. Raises `UnsupportedEndpoint` before reading anything.

    ``dimensions_problem(model, dimensions)`` judges an embeddings request's ``dimensions`` against the
    named model's catalog entry (what is wrong, or None); without it, no model takes ``dimensions``.
    ``params_problem(model, params)`` judges each line's params against the named model's engine;
    without it, params are not judged beyond what the conversion itself reads. ``base_model(model)`` says
    what each line's model runs on: lines may then name LoRA adapters of the batch's model (the job's model
    is their base; each such record keeps its adapter's name in ``model``); without it, every line must name
    the same model. ``media_problem(model, messages, field)`` judges a chat request's content parts against the
    named model's accepted media; without it, parts of any kind of media are judged only on where they come from.
    """
    checker = _RequestChecker(
        endpoint_for(endpoint), max_line_bytes, dimensions_problem, params_problem, base_model, media_problem
    )
    result = RequestConversion()
    seen_line = False
    for line_no, raw in _numbered_lines(source, max_line_bytes):
        if raw is not None and not raw.strip():
            continue
        seen_line = True
        checked = checker.check(line_no, raw)
        if isinstance(checked, RequestProblem):
            result._add(checked, max_problems)
            continue
        target.write(checked)
        result.records += 1
    if not seen_line:
        result._add(RequestProblem(None, "empty_file", "the file holds no request"), max_problems)
    if checker.reference is not None:
        result.model, result.params = checker.reference.model, checker.reference.params
    return result


def problems_to_openai_errors(problems: Iterable[RequestProblem]) -> dict[str, Any]:
    """The problems as a batch's ``errors`` object: ``{"object": "list", "data": [{code, message, param, line}]}``."""
    return {
        "object": "list",
        "data": [
            {"code": problem.code, "message": problem.message, "param": problem.param, "line": problem.line}
            for problem in problems
        ],
    }


def _numbered_lines(source: Iterable[bytes], max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """``(line number, line)`` for each line of the pieces, without its newline; None for a line too long."""
    line_no = 0
    pending = bytearray()
    too_long = False
    for chunk in source:
        *ends, rest = chunk.split(b"\n")
        for end in ends:
            line_no += 1
            if too_long or len(pending) + len(end) > max_line_bytes:
                yield line_no, None
            else:
                # Joining only when the line came in pieces: a line read whole is passed on uncopied.
                yield line_no, bytes(pending) + end if pending else end
            pending.clear()
            too_long = False
        if too_long:
            continue
        if len(pending) + len(rest) > max_line_bytes:
            # Forget the line's start: only its end, where the next line begins, still matters.
            pending.clear()
            too_long = True
        else:
            pending += rest
    if pending or too_long:
        yield line_no + 1, None if too_long else bytes(pending)


class _BadLine(Exception):
    """Raised while checking a line: its problem, but for the line number."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclass(frozen=True)
class _Reference:
    """The first good line: every other line must name its model; its params are the job's."""

    line: int
    model: str
    params: dict[str, Any]


class _RequestChecker:
    """Checks lines one by one, remembering the custom_ids seen and the first good line."""

    def __init__(
        self,
        endpoint: BatchEndpoint,
        max_line_bytes: int,
        dimensions_problem: DimensionsCheck | None = None,
        params_problem: ParamsCheck | None = None,
        base_model: BaseModel | None = None,
        media_problem: MediaCheck | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.max_line_bytes = max_line_bytes
        self.dimensions_problem = dimensions_problem
        self.params_problem = params_problem
        self.base_model = base_model
        self.media_problem = media_problem
        self.reference: _Reference | None = None
        self._first_lines: dict[str, int] = {}

    def check(self, line: int, raw: bytes | None) -> bytes | RequestProblem:
        """The line's Batchery record, newline-terminated, or its first problem; None stands for a line too long."""
        try:
            if raw is None:
                raise _BadLine("line_too_long", f"the line is longer than {self.max_line_bytes} bytes")
            return self._record(line, raw)
        except _BadLine as bad:
            return RequestProblem(line, bad.code, bad.message, bad.param)

    def _record(self, line: int, raw: bytes) -> bytes:
        try:
            request = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _BadLine("invalid_json", f"the line is not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(request, dict):
            raise _BadLine("invalid_json", f"the line must be a JSON object, not {_shown(request)}")
        custom_id = self._custom_id(line, request.get("custom_id"))
        if request.get("method") != "POST":
            raise _BadLine("invalid_method", _must("method", "'POST'", request.get("method")), "method")
        if request.get("url") != self.endpoint.url:
            expected = f"the batch's endpoint {self.endpoint.url!r}"
            raise _BadLine("invalid_url", _must("url", expected, request.get("url")), "url")
        body = request.get("body")
        if not isinstance(body, dict):
            raise _BadLine("missing_body", _must("body", "a JSON object", body), "body")
        named = body.get("model")
        model = self._model(named)
        value = _record_input(self.endpoint, body)
        if self.endpoint.task == "chat":
            self._check_media(model, value)
        params = {
            key: item
            for key, item in body.items()
            if key not in ("model", self.endpoint.request_field) and key not in CALLER_FIELDS
        }
        _check_params(self.endpoint, params)
        if self.endpoint.url == RESPONSES:
            params = _responses_params(params)
        if "dimensions" in params:
            self._check_dimensions(model, params["dimensions"])
        if self.params_problem is not None and (problem := self.params_problem(model, params)) is not None:
            param, message = problem
            body_param, body_message = _body_name(self.endpoint, param), _body_name(self.endpoint, message)
            raise _BadLine("invalid_param", f"body.{body_message}", f"body.{body_param}")
        record: dict[str, Any] = {"custom_id": custom_id, self.endpoint.input_field: value}
        if named != model:
            record["model"] = named  # an adapter of the batch's model: the record runs with it
        reference = self.reference
        if reference is None:
            self.reference = _Reference(line, model, params)
        elif params != reference.params:
            _check_batch_wide(reference, params)
            # A null stands for a field of the job's params this line leaves out: the engine's default.
            record["params"] = {**dict.fromkeys(reference.params), **params}
        return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)

    def _check_dimensions(self, model: str, dimensions: Any) -> None:
        if self.endpoint.task != "embed":
            message = f"body.dimensions is a parameter of /v1/embeddings, not of {self.endpoint.url}"
        elif self.dimensions_problem is None:
            message = "body.dimensions is not supported: no model here declares Matryoshka training"
        elif (problem := self.dimensions_problem(model, dimensions)) is not None:
            message = f"body.dimensions {problem}"
        else:
            return
        raise _BadLine("invalid_param", message, "body.dimensions")

    def _check_media(self, model: str, messages: list[Any]) -> None:
        """Refuse a content part the model may not be given, or one a slot would have to fetch."""
        field = f"body.{self.endpoint.request_field}"
        media_problem = self.media_problem or (lambda _, messages, field: messages_media_problem(messages, field=field))
        if (problem := media_problem(model, messages, field)) is not None:
            raise _BadLine("invalid_input", problem.message, problem.where)

    def _custom_id(self, line: int, custom_id: Any) -> str:
        if not isinstance(custom_id, str) or not custom_id:
            raise _BadLine("missing_custom_id", _must("custom_id", "a non-empty string", custom_id), "custom_id")
        # Every well-formed id is taken, even on a line bad otherwise: a duplicate is named whatever else is wrong.
        first = self._first_lines.setdefault(custom_id, line)
        if first != line:
            message = f"custom_id {custom_id!r} is already used on line {first}; each request needs its own"
            raise _BadLine("duplicate_custom_id", message, "custom_id")
        return custom_id

    def _model(self, named: Any) -> str:
        """The catalog model the line runs on: the one it names, or the base model of the adapter it names."""
        if not isinstance(named, str) or not named:
            raise _BadLine("missing_model", _must("body.model", "a model's name", named), "body.model")
        model = (self.base_model(named) if self.base_model is not None else None) or named
        reference = self.reference
        if reference is not None and model != reference.model:
            runs_on = "" if model == named else f" (an adapter of {model!r})"
            message = (
                f"body.model is {named!r}{runs_on}, but line {reference.line} runs on {reference.model!r}; "
                "a batch runs one model and its adapters, so every request must name that model or an adapter of it"
            )
            raise _BadLine("mixed_models", message, "body.model")
        return model


def _record_input(endpoint: BatchEndpoint, body: dict[str, Any]) -> Any:
    """The record's input from the request body."""
    name = f"body.{endpoint.request_field}"
    if endpoint.request_field not in body:
        raise _BadLine("missing_input", f"{name} is missing: an {endpoint.url} request needs one", name)
    value = body[endpoint.request_field]
    if endpoint.url == RESPONSES:
        return _responses_conversation(value, body.get("instructions"))
    if endpoint.task == "chat":
        if not _is_conversation(value):
            message = (
                f"{name} must be a non-empty list of messages, each an object with a string 'role' "
                "and a 'content' (a string or a list of parts)"
            )
            raise _BadLine("invalid_input", message, name)
        return value
    if endpoint.task == "embed":
        # A text, a token array, or a list of either, as the native API's records take them; a list of one
        # is unwrapped, since its response is the same and a record of one input is the common, smaller one.
        if (problem := input_problem(endpoint.input_field, value)) is not None:
            raise _BadLine("invalid_input", f"body.{problem}", name)
        return value[0] if isinstance(value, list) and len(value) == 1 and not is_token_array(value) else value
    # Completions and moderations take a text; Batchery runs one input a record, so a list of one is unwrapped.
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        if len(value) == 1:
            return value[0]
        noun = "prompt" if endpoint.task == "generate" else "input"
        message = (
            f"{name} holds {len(value)} {noun}s, but Batchery runs one {noun} a request: "
            f"give each {noun} its own line and custom_id"
        )
        raise _BadLine("invalid_input", message, name)
    raise _BadLine("invalid_input", _must(name, "a string (or a list of one string)", value), name)


def _responses_conversation(value: Any, instructions: Any) -> list[dict[str, Any]]:
    """A Responses API ``input`` (a text, or a list of messages of text) and its ``instructions`` as chat messages."""
    if instructions is not None and not isinstance(instructions, str):
        raise _BadLine("invalid_input", _must("body.instructions", "a string", instructions), "body.instructions")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(value, str) and value:
        return [*messages, {"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _BadLine("invalid_input", _must("body.input", "a string or a list of messages", value), "body.input")
    for index, item in enumerate(value):
        messages.append(_responses_message(item, f"body.input[{index}]"))
    return messages


def _responses_message(item: Any, name: str) -> dict[str, Any]:
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        # Function calls, their outputs and reasoning items need tools, which Batchery does not run.
        raise _BadLine("invalid_input", _must(name, "a message (type 'message')", item), name)
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "assistant", "system", "developer"):
        raise _BadLine("invalid_input", _must(f"{name}.role", "user, assistant, system or developer", role), name)
    if isinstance(content, str):
        return {"role": role, "content": content}
    parts = content if isinstance(content, list) else None
    texts = [
        part["text"]
        for part in parts or ()
        if isinstance(part, dict)
        and part.get("type") in ("input_text", "output_text")
        and isinstance(part.get("text"), str)
    ]
    if not parts or len(texts) != len(parts):
        message = _must(f"{name}.content", "a string or a list of input_text parts (text only)", content)
        raise _BadLine("invalid_input", message, f"{name}.content")
    return {"role": role, "content": "".join(texts)}


def _responses_params(params: dict[str, Any]) -> dict[str, Any]:
    """A Responses API body's params in chat's names; ``instructions`` went into the conversation."""
    params.pop("instructions", None)
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if params.get(name) is not None:
            # The Responses API's tools (built-in ones among them) and its function-call output items differ
            # from chat's; only chat's are served.
            message = (
                f"body.{name} is not supported on /v1/responses here; tool calls are served on /v1/chat/completions"
            )
            raise _BadLine("invalid_param", message, f"body.{name}")
    if params.get("top_logprobs") is not None:
        # A Response carries logprobs only when `include` asks for them, which is not served here.
        message = "body.top_logprobs is not supported on /v1/responses: its answers carry no logprobs here"
        raise _BadLine("invalid_param", message, "body.top_logprobs")
    if params.get("truncation") in (None, "disabled"):
        # OpenAI's default: a request too long for the model fails, as it does here without truncate.
        params.pop("truncation", None)
    elif params.get("truncation") == "auto":
        params["truncate"] = True
        del params["truncation"]
    text = params.get("text")
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format"}:
            raise _BadLine("invalid_param", _must("body.text", 'an object {"format": ...}', text), "body.text")
        text_format = text.get("format")
        if isinstance(text_format, dict) and text_format.get("type") == "json_schema":
            # The Responses API puts the schema's name and options beside its type; chat nests them.
            text_format = {
                "type": "json_schema",
                "json_schema": {key: item for key, item in text_format.items() if key != "type"},
            }
        params["text"] = text_format
    return {RESPONSES_PARAMS.get(key, key): item for key, item in params.items()}


_RESPONSES_NAMES = (
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("truncate", "truncation"),
)
"""Engine param names, longest first, and what a Responses API body calls them."""


def _body_name(endpoint: BatchEndpoint, text: str) -> str:
    """A param's name, or a message that starts with it, in the words of the request body."""
    if endpoint.url != RESPONSES:
        return text
    for engine_name, body_name in _RESPONSES_NAMES:
        if text == engine_name or text.startswith((engine_name + ".", engine_name + " ")):
            return body_name + text[len(engine_name) :]
    return text


def _is_conversation(messages: Any) -> bool:
    return isinstance(messages, list) and bool(messages) and all(_is_message(message) for message in messages)


def _is_message(message: Any) -> bool:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return False
    if isinstance(message.get("content"), str | list):
        return True
    # An assistant turn of tool calls has no content, as OpenAI's clients send it back.
    return (
        message["role"] == "assistant" and isinstance(message.get("tool_calls"), list) and bool(message["tool_calls"])
    )


def _check_params(endpoint: BatchEndpoint, params: dict[str, Any]) -> None:
    """Refuse a param the conversion itself reads and could not honour."""
    encoding = params.get("encoding_format")
    if endpoint.task == "embed" and encoding is not None and encoding not in EMBEDDING_ENCODINGS:
        message = _must("body.encoding_format", "'float' or 'base64'", encoding)
        raise _BadLine("invalid_param", message, "body.encoding_format")
    if params.get("stream"):
        raise _BadLine(
            "invalid_param", "body.stream must be false or left out: a batch's responses do not stream", "body.stream"
        )
    params.pop("stream", None)


def _check_batch_wide(reference: _Reference, params: dict[str, Any]) -> None:
    for name in sorted(BATCH_WIDE_FIELDS):
        if params.get(name) != reference.params.get(name):
            message = (
                f"body.{name} differs from line {reference.line}'s; it shapes the whole output file, "
                "so every request of a batch must give the same"
            )
            raise _BadLine("mixed_params", message, f"body.{name}")


def _must(name: str, expected: str, value: Any) -> str:
    """The message for a field that is missing, or holds something else than ``expected``."""
    if value is None:
        return f"{name} is missing; it must be {expected}"
    return f"{name} must be {expected}, not {_shown(value)}"


def _shown(value: Any) -> str:
    """A JSON value for a message: scalars as given (long strings cut), objects and lists by their kind."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list" if value else "an empty list"
    if isinstance(value, str) and len(value) > SHOWN_STRING_CHARS:
        return repr(value[:SHOWN_STRING_CHARS]) + "..."
    if value is None or isinstance(value, bool):
        return orjson.dumps(value).decode()  # null, true, false: as the file spells them
    return repr(value)
