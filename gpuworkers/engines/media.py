"""Media in chat messages: which content parts a conversation may carry, and where their bytes may come from.

vLLM's chat parser fetches every URL a content part gives (``image_url``, ``audio_url``, ``video_url``) from the
GPU host, following redirects, before it asks whether the model takes that kind of input: a tenant's record
could make a slot request any address it can reach, cloud metadata included. So a part is taken only where
`MediaPolicy` allows it: text always; media of a kind the model accepts, inline (a ``data:`` URL, or
``input_audio``'s base64 data) within a size bound, or as an ``https://`` URL on a host the operator listed
(``BATCHERY_MEDIA_ALLOWED_HOSTS``, exact names, never IP addresses). Parts that make vLLM load something other
than bytes (``image_embeds`` are torch tensors, ``image_pil`` a Python object, ``file`` a file id) are refused,
as is any type this table does not know.

The portal judges each record with the model's accepted modalities at submission (naming the line and the
part); the slot judges every conversation again before vLLM's parser sees it, with every modality allowed
(the model itself refuses a kind it does not take), for anything accepted before these checks existed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gpuworkers.engines.base import json_kind
from gpuworkers.engines.vllm_load import parameter_names
from tasks.shared.config import MAX_MEDIA_BYTES, MAX_MEDIA_RECORD_BYTES, MEDIA_ALLOWED_HOSTS, is_host_name

TEXT_PART_TYPES: dict[str, str] = {"text": "text", "refusal": "refusal"}
"""Content parts of text alone, always taken, and the field that holds their text (an assistant turn sent back
may hold OpenAI's ``refusal`` parts)."""

MEDIA_PART_MODALITIES: dict[str, str] = {
    "image_url": "image",
    "input_audio": "audio",
    "audio_url": "audio",
    "video_url": "video",
}
"""Content parts of media that may be served, and the kind of input (modality) each is."""

REFUSED_PART_TYPES: dict[str, str] = {
    "image_embeds": "precomputed embeddings are loaded as torch tensors on the GPU host",
    "audio_embeds": "precomputed embeddings are loaded as torch tensors on the GPU host",
    "image_pil": "a Python image object cannot travel in JSON",
    "file": "files are not served; give an image as an image_url part with a data: URL",
    "input_image": "this is a Responses API part; give an image_url part",
    "input_file": "this is a Responses API part; files are not served",
}
"""Content parts vLLM's parser knows that are never served, and why."""

MODALITIES = ("text", *sorted(set(MEDIA_PART_MODALITIES.values())))
"""Every kind of input a catalog entry may say its model accepts."""


@dataclass(frozen=True)
class MediaPolicy:
    """What a conversation's content parts may carry, and how much."""

    modalities: frozenset[str]
    """The kinds of input the model accepts (`MODALITIES`); text is always taken."""
    allowed_hosts: frozenset[str]
    """Host names whose ``https://`` URLs may be given, lower case; empty: inline media only."""
    max_part_bytes: int
    """The most bytes one part's inline media may hold, as written (``BATCHERY_MAX_MEDIA_BYTES``)."""
    max_record_bytes: int
    """The most bytes of inline media a whole conversation may hold (``BATCHERY_MAX_MEDIA_RECORD_BYTES``)."""

    @classmethod
    def configured(cls, modalities: Sequence[str] = MODALITIES) -> MediaPolicy:
        """The operator's bounds and hosts, for a model accepting `modalities` (every kind: the slot's check)."""
        return cls(
            modalities=frozenset(modalities),
            allowed_hosts=frozenset(MEDIA_ALLOWED_HOSTS.read()),
            max_part_bytes=MAX_MEDIA_BYTES.read(),
            max_record_bytes=MAX_MEDIA_RECORD_BYTES.read(),
        )


@dataclass(frozen=True)
class MediaProblem:
    """What is wrong with one content part of a conversation."""

    where: str
    """The part, e.g. ``messages[0].content[1]``."""
    message: str
    """What is wrong, for a person, starting with `where`."""


def messages_media_problem(
    messages: Any, policy: MediaPolicy | None = None, *, field: str = "messages"
) -> MediaProblem | None:
    """The first content part of ``messages`` that `policy` does not allow; None if there is none.

    A message's content may be a string, or a list of parts (strings, or objects with a ``type``). A value that
    is not a list of message objects is not this check's to judge (the record's shape checks say so). Without a
    `policy`, the configured one for a model taking every kind of media, read only once a list of parts is met:
    most records hold none, and the planner checks millions.
    """
    if not isinstance(messages, list):
        return None
    inline_total = 0
    for number, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if content is None or isinstance(content, str):
            continue
        policy = policy or MediaPolicy.configured()
        where = f"{field}[{number}].content"
        if not isinstance(content, list):
            return MediaProblem(where, f"{where} must be a string or a list of content parts, not {json_kind(content)}")
        for index, part in enumerate(content):
            problem, size = _part_problem(part, f"{where}[{index}]", policy)
            if problem is not None:
                return problem
            inline_total += size
            if inline_total > policy.max_record_bytes:
                return MediaProblem(
                    f"{where}[{index}]",
                    f"{where}[{index}] brings this record's media to {inline_total} bytes, over the limit of "
                    f"{policy.max_record_bytes} a record (BATCHERY_MAX_MEDIA_RECORD_BYTES)",
                )
    return None


def require_fetch_free(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` itself, once no part would make vLLM's parser fetch or load what a tenant names.

    The slot's check, with every modality allowed: raises ValueError naming the part otherwise, which errors
    the record alone.
    """
    problem = messages_media_problem(messages)
    if problem is not None:
        raise ValueError(problem.message)
    return messages


NO_MEDIA_HOST = "media.invalid"
"""The only media domain vLLM is allowed where the operator lists none: ``.invalid`` never resolves (RFC 2606),
and an empty list would allow every domain."""


def confine_media_fetches(vllm: Any) -> dict[str, Any]:
    """`vllm.LLM` arguments that keep vLLM's own media fetches to what this module allows; turns off vLLM's
    following of redirects for the process (a listed media host must not bounce a fetch elsewhere).

    No local files (``allowed_local_media_path`` empty), and URLs only on the operator's media hosts
    (``allowed_media_domains``), each where the vLLM at hand has the argument. They override the catalog's
    load params: `require_fetch_free` of each conversation comes first, and this holds where it missed one.
    """
    os.environ["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] = "0"
    arguments = parameter_names(vllm.LLM) | parameter_names(getattr(vllm, "EngineArgs", None))
    kwargs: dict[str, Any] = {}
    if "allowed_local_media_path" in arguments:
        kwargs["allowed_local_media_path"] = ""
    if "allowed_media_domains" in arguments:
        kwargs["allowed_media_domains"] = sorted(MediaPolicy.configured().allowed_hosts) or [NO_MEDIA_HOST]
    return kwargs


def _part_problem(part: Any, where: str, policy: MediaPolicy) -> tuple[MediaProblem | None, int]:
    """What is wrong with one part, and the inline media bytes it holds."""
    if isinstance(part, str):
        return None, 0
    if not isinstance(part, dict):
        return MediaProblem(where, f"{where} must be a content part object or a string, not {json_kind(part)}"), 0
    kind = part.get("type")
    if not isinstance(kind, str):
        # vLLM guesses a part's type from its keys where none is given; nothing here is left to a guess.
        return MediaProblem(where, f"{where} must name its type ('type': 'text', 'image_url', ...)"), 0
    if kind in TEXT_PART_TYPES:
        if not isinstance(part.get(TEXT_PART_TYPES[kind]), str):
            return MediaProblem(where, f"{where} is a {kind} part whose {TEXT_PART_TYPES[kind]!r} must be a string"), 0
        return None, 0
    if kind in REFUSED_PART_TYPES:
        return MediaProblem(where, f"{where} is of type {kind!r}, which is not served: {REFUSED_PART_TYPES[kind]}"), 0
    modality = MEDIA_PART_MODALITIES.get(kind)
    if modality is None:
        known = ", ".join(sorted([*TEXT_PART_TYPES, *MEDIA_PART_MODALITIES]))
        return MediaProblem(where, f"{where} has type {kind!r}, which is not a content part served here ({known})"), 0
    if modality not in policy.modalities:
        accepted = ", ".join(sorted(policy.modalities | {"text"}))
        return MediaProblem(
            where, f"{where} is {modality} input ({kind!r}), which this model does not accept; it takes {accepted}"
        ), 0
    if kind == "input_audio":
        return _inline_audio_problem(part.get("input_audio"), f"{where}.input_audio", policy)
    source = part.get(kind)
    url = source.get("url") if isinstance(source, dict) else source
    if not isinstance(url, str) or not url:
        return MediaProblem(f"{where}.{kind}", f"{where}.{kind} must hold a 'url' string"), 0
    return _url_problem(url, f"{where}.{kind}.url", modality, policy)


def _inline_audio_problem(audio: Any, where: str, policy: MediaPolicy) -> tuple[MediaProblem | None, int]:
    data = audio.get("data") if isinstance(audio, dict) else None
    if not isinstance(data, str) or not data:
        return MediaProblem(where, f"{where} must be an object with base64 'data' and a 'format'"), 0
    return _size_problem(len(data), f"{where}.data", policy), len(data)


def _url_problem(url: str, where: str, modality: str, policy: MediaPolicy) -> tuple[MediaProblem | None, int]:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        header = url[5 : url.find(",")] if "," in url else ""
        if not header.lower().startswith(f"{modality}/") or not header.lower().endswith(";base64"):
            message = f"{where} must be a data URL of base64 {modality} ('data:{modality}/...;base64,...')"
            return MediaProblem(where, message), 0
        return _size_problem(len(url), where, policy), len(url)
    host = _https_host(url) if scheme == "https" else None
    if host is not None and host in policy.allowed_hosts:
        return None, 0
    if not policy.allowed_hosts:
        allowed = "only inline media is taken: a data: URL"
    else:
        allowed = f"media is taken as a data: URL, or an https:// URL on {', '.join(sorted(policy.allowed_hosts))}"
    shown = url if len(url) <= 80 else f"{url[:77]}..."
    return MediaProblem(where, f"{where} is {shown!r}: slots fetch nothing a record names; {allowed}"), 0


def _size_problem(size: int, where: str, policy: MediaPolicy) -> MediaProblem | None:
    if size <= policy.max_part_bytes:
        return None
    return MediaProblem(
        where,
        f"{where} holds {size} bytes, over the limit of {policy.max_part_bytes} a media part "
        "(BATCHERY_MAX_MEDIA_BYTES)",
    )


def _https_host(url: str) -> str | None:
    """The URL's host where it is a plain https URL by name (no credentials, no other port); None otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    host = (parts.hostname or "").lower()
    if parts.username is not None or port not in (None, 443) or not is_host_name(host):
        return None
    return host
