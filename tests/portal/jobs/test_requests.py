"""One request object: the API's serializer, the web form and the command line state the same submission
as the same `JobRequest`, and a re-run states its job's again."""

from __future__ import annotations

from typing import Any

from portal.api.serializers import JobCreateSerializer
from portal.catalog.models import Model
from portal.jobs.management.commands.submit import Command, job_request
from portal.jobs.requests import JobRequest
from portal.web.forms import SubmitForm

INPUT = "file:///srv/data/input.csv"
EXPECTED = JobRequest(
    model_name="all-MiniLM-L6-v2",
    model_version="1",
    input_uri=INPUT,
    params={"normalize": True},
    shard_size=40,
    deadline_seconds=600,
    input_format="csv",
    text_column="body",
    id_column="id",
    output_format="parquet",
    priority=3,
)


def test_the_serializer_the_form_and_the_command_line_state_the_same_request(minilm: Any) -> None:
    api = JobCreateSerializer(
        data={
            "model": "all-MiniLM-L6-v2", "model_version": "1", "input_uri": INPUT, "params": {"normalize": True},
            "shard_size": 40, "deadline_seconds": 600, "input_format": "csv", "text_column": "body", "id_column": "id",
            "output_format": "parquet", "priority": 3,
        }
    )  # fmt: skip
    assert api.is_valid(), api.errors
    web = SubmitForm(
        data={
            "model": str(minilm.pk), "input_uri": INPUT, "params": '{"normalize": true}', "shard_size": "40",
            "deadline_seconds": "600", "input_format": "csv", "text_column": " body ", "id_column": "id",
            "output_format": "parquet", "priority": "3",
        },
        models=Model.objects.all(),
    )  # fmt: skip
    assert web.is_valid(), web.errors
    parser = Command().create_parser("manage.py", "submit")
    cli = vars(
        parser.parse_args(
            ["--model", "all-MiniLM-L6-v2", "--model-version", "1", "--input", INPUT, "--params", '{"normalize": true}',
             "--shard-size", "40", "--deadline", "600", "--format", "csv", "--text-column", "body", "--id-column", "id",
             "--output-format", "parquet", "--priority", "3"]
        )
    )  # fmt: skip

    assert minilm.version == "1"
    assert api.job_request(INPUT) == web.job_request(INPUT) == job_request(cli) == EXPECTED
