"""The OpenAPI schema and its docs page are served without credentials, with nothing fetched from a CDN."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from django.core.management import call_command
from rest_framework.test import APIClient

from tests.api.conftest import Caller

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


def test_the_schema_generates_without_a_single_warning_and_validates(tmp_path: Path) -> None:
    # drf-spectacular's own check, as `make test` runs it: any warning (an unresolvable
    # authentication class, a colliding operation id or enum name) fails.
    call_command("spectacular", "--fail-on-warn", "--validate", "--file", str(tmp_path / "schema.yml"))


def test_every_operation_is_named_once_and_tells_clients_to_send_the_api_key() -> None:
    schema = yaml.safe_load(APIClient().get("/api/schema/").content)
    operations = [
        (path, method, operation)
        for path, methods in schema["paths"].items()
        for method, operation in methods.items()
        if method in {"get", "post", "put", "patch", "delete"}
    ]
    ids = Counter(operation["operationId"] for _, _, operation in operations)
    assert [name for name, count in ids.items() if count > 1] == []
    schemes = schema["components"]["securitySchemes"]
    bearer = [name for name, scheme in schemes.items() if (scheme["type"], scheme.get("scheme")) == ("http", "bearer")]
    assert len(bearer) == 1
    unauthenticated = [
        (path, method)
        for path, method, operation in operations
        if path.startswith(("/api/v1/", "/v1/")) and {bearer[0]: []} not in operation.get("security", [])
    ]
    assert unauthenticated == []
    # OpenAI's own names, so that clients generated from either spec call the same methods.
    openai = {operation["operationId"] for path, _, operation in operations if path.startswith("/v1/")}
    assert {
        "listFiles",
        "createFile",
        "retrieveFile",
        "deleteFile",
        "downloadFile",
        "listBatches",
        "createBatch",
        "retrieveBatch",
        "cancelBatch",
    } <= openai


def test_a_batch_is_cancelled_only_by_post_and_a_file_deleted_only_at_its_own_address(
    caller: Callable[..., Caller],
) -> None:
    client = caller().client
    assert client.get("/v1/batches/batch_x/cancel").status_code == 405
    assert client.delete("/v1/files/file-x/content").status_code == 405
    assert client.post("/v1/batches/batch_x/cancel").status_code == 404, "the method itself is there"
