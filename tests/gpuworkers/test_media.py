"""Which content parts a chat record may carry (`gpuworkers.engines.media`): text always; media of a kind the
model takes, inline within the bounds or on an operator's https media host; nothing a slot would fetch."""

from __future__ import annotations

from typing import Any

import pytest

from gpuworkers.engines.media import MODALITIES, MediaPolicy, messages_media_problem
from tasks.shared.env import ImproperlyConfiguredEnv

IMAGES = MediaPolicy(
    modalities=frozenset({"text", "image"}), allowed_hosts=frozenset(), max_part_bytes=100, max_record_bytes=150
)


def with_part(part: Any) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, part]},
    ]


def problem(part: Any, policy: MediaPolicy = IMAGES) -> str | None:
    found = messages_media_problem(with_part(part), policy)
    return None if found is None else found.message


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "https://169.254.169.254/latest/meta-data/",
        "http://127.0.0.1:8000/admin/",
        "http://[::1]/",
        "http://metadata.google.internal/computeMetadata/v1/",
        "https://images.example.com/cat.png",
        "file:///etc/passwd",
        "ftp://10.0.0.1/x",
    ],
)
def test_a_media_url_is_refused_naming_the_part_where_no_media_host_is_listed(url: str) -> None:
    message = problem(image(url))
    assert message is not None
    assert message.startswith("messages[1].content[1].image_url.url is ")
    assert "slots fetch nothing a record names; only inline media is taken: a data: URL" in message


def test_a_url_given_as_a_bare_string_is_judged_alike() -> None:
    assert problem({"type": "image_url", "image_url": "http://127.0.0.1/"}) is not None


def test_an_https_url_on_a_listed_host_is_taken_and_nothing_else() -> None:
    policy = MediaPolicy(
        modalities=frozenset({"text", "image"}),
        allowed_hosts=frozenset({"images.example.com"}),
        max_part_bytes=100,
        max_record_bytes=150,
    )
    assert problem(image("https://images.example.com/cat.png"), policy) is None
    assert problem(image("https://IMAGES.example.com/cat.png"), policy) is None
    for refused in (
        "http://images.example.com/cat.png",
        "https://images.example.com:8443/cat.png",
        "https://user@images.example.com/cat.png",
        "https://images.example.com.evil.test/cat.png",
        "https://other.example.com/cat.png",
    ):
        message = problem(image(refused), policy)
        assert message is not None and "an https:// URL on images.example.com" in message, refused


def test_an_operator_lists_names_and_a_listed_address_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BATCHERY_MEDIA_ALLOWED_HOSTS", "Media.Example.com, cdn.example.org")
    assert MediaPolicy.configured().allowed_hosts == frozenset({"media.example.com", "cdn.example.org"})
    monkeypatch.setenv("BATCHERY_MEDIA_ALLOWED_HOSTS", "169.254.169.254, [::1], 2130706433, 0x7f.1, media.example.com")
    with pytest.raises(ImproperlyConfiguredEnv) as refused:
        MediaPolicy.configured()
    assert str(refused.value) == (
        "BATCHERY_MEDIA_ALLOWED_HOSTS lists 169.254.169.254, [::1], 2130706433, 0x7f.1: media hosts are DNS names, "
        "never addresses"
    )


def test_an_inline_image_is_taken_within_the_bound_of_a_part_and_of_a_record() -> None:
    small = "data:image/png;base64," + "A" * 40
    assert problem(image(small)) is None
    message = problem(image("data:image/png;base64," + "A" * 100))
    assert message == (
        "messages[1].content[1].image_url.url holds 122 bytes, over the limit of 100 a media part "
        "(BATCHERY_MAX_MEDIA_BYTES)"
    )
    messages = [{"role": "user", "content": [image(small), image(small), image(small)]}]
    found = messages_media_problem(messages, IMAGES)
    assert found is not None and found.where == "messages[0].content[2]"
    assert "over the limit of 150 a record (BATCHERY_MAX_MEDIA_RECORD_BYTES)" in found.message


def test_a_data_url_of_another_kind_than_its_part_is_refused() -> None:
    message = problem(image("data:text/html;base64,PGgxPg=="))
    assert message is not None and "must be a data URL of base64 image" in message


def test_media_the_model_does_not_take_is_refused_naming_what_it_takes() -> None:
    text_only = MediaPolicy(frozenset({"text"}), frozenset(), 100, 150)
    assert problem(image("data:image/png;base64,AAAA"), text_only) == (
        "messages[1].content[1] is image input ('image_url'), which this model does not accept; it takes text"
    )
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    assert "audio input" in (problem(audio) or "")
    assert problem(audio, MediaPolicy(frozenset(MODALITIES), frozenset(), 100, 150)) is None


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        ({"type": "image_embeds", "image_embeds": "AAAA"}, "is of type 'image_embeds', which is not served"),
        ({"type": "image_pil", "image_pil": "x"}, "is of type 'image_pil', which is not served"),
        ({"type": "file", "file": {"file_id": "file-1"}}, "is of type 'file', which is not served"),
        ({"type": "image", "source": {"type": "url", "url": "http://x"}}, "has type 'image', which is not a content"),
        ({"image_url": {"url": "http://127.0.0.1/"}}, "must name its type"),
        ({"type": "text", "text": 3}, "is a text part whose 'text' must be a string"),
        (7, "must be a content part object or a string, not a number"),
    ],
)
def test_parts_not_served_are_refused_naming_the_part(part: Any, expected: str) -> None:
    message = problem(part, MediaPolicy(frozenset(MODALITIES), frozenset(), 100, 150))
    assert message is not None and message.startswith("messages[1].content[1] ") and expected in message


def test_text_in_any_shape_is_always_taken() -> None:
    policy = MediaPolicy(frozenset({"text"}), frozenset(), 1, 1)
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": ["a plain string part", {"type": "text", "text": "t"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
    ]
    assert messages_media_problem(messages, policy) is None
