from __future__ import annotations

from django.apps import AppConfig


class AnthropicApiConfig(AppConfig):
    name = "portal.anthropic_api"
    label = "anthropic_api"
    verbose_name = "Anthropic-compatible message batches"
