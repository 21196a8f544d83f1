"""The OpenAPI schema and its docs page are served without credentials, with nothing fetched from a CDN."""

from __future__ import annotations

import pytest
import yaml
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db


def test_the_schema_documents_every_api_operation_and_the_one_error_shape() -> None:
    response = APIClient().get("/api/schema/")
    assert response.status_code == 200
    schema = yaml.safe_load(response.content)
    assert schema["openapi"].startswith("3.")
    paths = schema["paths"]
    for path in ("/api/v1/jobs/", "/api/v1/jobs/{id}/cancel/", "/api/v1/usage/periods/", "/v1/batches", "/v1/files"):
        assert path in paths, path
    assert paths["/api/v1/jobs/"]["post"]["responses"]["429"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"
    }
    assert schema["components"]["schemas"]["Error"]["required"] == ["error"]


def test_the_docs_page_loads_its_assets_locally() -> None:
    response = APIClient().get("/api/docs/")
    assert response.status_code == 200
    page = response.content.decode()
    assert "drf_spectacular_sidecar/swagger-ui-dist" in page
    assert "cdn." not in page and "jsdelivr" not in page
