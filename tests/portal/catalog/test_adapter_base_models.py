"""The models a tenant is offered to register adapters on are those `adapter_register` would take: the
newest enabled version of each name it may use, of an engine and task that serve adapters."""

from __future__ import annotations

import pytest

from portal.catalog.adapters import adapter_base_models
from portal.catalog.models import Model
from portal.tenancy.models import Quota, Tenant
from tests.factories import ModelFactory

pytestmark = pytest.mark.django_db


def _model(name: str, **fields: object) -> Model:
    defaults: dict[str, object] = {"engine": Model.Engine.TRANSFORMERS, "task": Model.Task.CHAT, "is_default": False}
    return ModelFactory(name=name, source="/models/" + name, **{**defaults, **fields})


def test_only_models_that_serve_adapters_are_offered_in_their_newest_enabled_version(acme: Tenant) -> None:
    _model("chat", version="1")
    newest = _model("chat", version="2")
    _model("chat", version="3", enabled=False)
    generator = _model("writer", task=Model.Task.GENERATE)
    lora_vllm = _model("big", engine=Model.Engine.VLLM, load_params={"enable_lora": True})
    _model("big-plain", engine=Model.Engine.VLLM)
    _model("embedder", engine=Model.Engine.SENTENCE_TRANSFORMERS, task=Model.Task.EMBED)
    _model("tagger", task=Model.Task.CLASSIFY)

    assert adapter_base_models(acme) == [lora_vllm, newest, generator]


def test_a_quota_that_narrows_the_models_narrows_the_offer(acme: Tenant) -> None:
    allowed = _model("chat")
    _model("writer", task=Model.Task.GENERATE)
    quota, _ = Quota.objects.get_or_create(tenant=acme)
    quota.allowed_models.add(allowed)

    assert adapter_base_models(acme) == [allowed]
