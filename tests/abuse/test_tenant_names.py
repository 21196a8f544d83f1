"""Attacks on names: a tenant reading the platform's names (storage root, folders, tenant numbers, where the
operators keep a model) from its answers, probing models outside its quota, naming an S3 object outside its
prefixes through a key the store reads differently, keeping a removed admin's invitations alive, outliving
an operator's bulk change in the key cache, and giving a job's records many model names."""

from __future__ import annotations

import io
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import orjson
import pytest

from tests.abuse.conftest import scale
from tests.support.abuse import MODEL, AbuseResult, AbuseStack, TenantAccess

pytestmark = [pytest.mark.slow, pytest.mark.abuse]


def _lines(records: list[dict[str, object]]) -> bytes:
    return b"".join(orjson.dumps(record) + b"\n" for record in records)


def _ended(client: httpx.Client, path: str, done: set[str], key: str = "status", timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while (found := client.get(path).json())[key] not in done:
        assert time.monotonic() < deadline, found
        time.sleep(0.2)
    return found


@contextmanager
def _signed_in(stack: AbuseStack, access: TenantAccess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base_url, timeout=30) as browser:
        answer = browser.post(
            "/login/",
            data={"username": access.username, "password": access.password,
                  "csrfmiddlewaretoken": _csrf(browser, "/login/")},
        )  # fmt: skip
        assert answer.status_code == 302, answer.text[:300]
        yield browser


def _csrf(browser: httpx.Client, page: str) -> str:
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', browser.get(page).text)
    assert token, page
    return token.group(1)


def test_a_tenant_reads_none_of_the_platforms_names(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    reader = abuse_stack.tenant("name-reader")
    with abuse_stack.db():
        from portal.catalog.models import Model
        from portal.tenancy.models import Tenant

        source = Model.objects.get(name=MODEL).source
        tenant_pk = Tenant.objects.get(name="name-reader").pk
    forbidden = [str(abuse_stack.storage_root), abuse_stack.storage_root.as_uri(), str(abuse_stack.data_dir),
                 source, f"uploads/{tenant_pk}/"]  # fmt: skip
    records = [{"custom_id": f"n{n}", "input": f"name {n}"} for n in range(3)]
    batch_lines = [
        {"custom_id": f"b{n}", "method": "POST", "url": "/v1/embeddings", "body": {"model": MODEL, "input": f"b {n}"}}
        for n in range(3)
    ]

    def attack() -> str:
        answers: list[httpx.Response] = []
        with abuse_stack.api(reader) as client:
            created = client.post(
                "/api/v1/jobs/", data={"model": MODEL}, files={"file": ("names.jsonl", io.BytesIO(_lines(records)))}
            )
            assert created.status_code == 201, created.text
            job_id = created.json()["id"]
            uploaded = client.post(
                "/v1/files", data={"purpose": "batch"}, files={"file": ("b.jsonl", io.BytesIO(_lines(batch_lines)))}
            )
            assert uploaded.status_code == 200, uploaded.text
            batch = client.post(
                "/v1/batches",
                json={"input_file_id": uploaded.json()["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"},
            )
            assert batch.status_code == 200, batch.text
            _ended(client, f"/api/v1/jobs/{job_id}/", {"succeeded", "partially_succeeded", "failed"})
            ended = _ended(client, f"/v1/batches/{batch.json()['id']}", {"completed", "failed", "expired"})
            for path in (f"/api/v1/jobs/{job_id}/", "/api/v1/jobs/", f"/api/v1/jobs/{job_id}/manifest/",
                         f"/api/v1/jobs/{job_id}/output/", f"/api/v1/jobs/{job_id}/errors/",
                         f"/v1/batches/{ended['id']}", "/v1/batches", "/v1/files"):  # fmt: skip
                answers.append(client.get(path))
            for file_id in (ended.get("output_file_id"), ended.get("error_file_id")):
                if file_id:
                    answers += [client.get(f"/v1/files/{file_id}"), client.get(f"/v1/files/{file_id}/content")]
            # Anthropic's batches run chat models: naming the embedding model is refused, naming nothing of ours.
            answers.append(client.post("/v1/messages/batches", json={"requests": [{"custom_id": "a", "params": {
                "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}}]}))  # fmt: skip
        with _signed_in(abuse_stack, reader) as browser:
            answers += [browser.get(f"/jobs/{job_id}/"), browser.get(f"/jobs/{job_id}/live/"), browser.get("/")]
        for answer in answers:
            assert answer.status_code < 500, (answer.url, answer.text[:300])
            found = [name for name in forbidden if name in answer.text]
            assert not found, (answer.url, found, answer.text[:500])
        return f"{len(answers)} answers (job, manifest, files, OpenAI batch and files, portal pages): no platform name"

    abuse_report("the platform's names in a tenant's answers", attack)


def test_a_model_outside_the_quota_answers_as_one_that_does_not_exist(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    prober = abuse_stack.tenant("model-prober")
    with abuse_stack.db():
        from portal.catalog.models import Model
        from portal.tenancy.models import Quota
        from tests.factories import ModelFactory

        hidden = ModelFactory(name="hidden-chat", task=Model.Task.CHAT, engine=Model.Engine.TRANSFORMERS,
                              source="/srv/hidden-chat", is_default=False)  # fmt: skip
        Quota.objects.get(tenant__name="model-prober").allowed_models.set(Model.objects.filter(name=MODEL))
    body = _lines([{"custom_id": "a", "input": "x"}])

    def same(answer: httpx.Response, other: httpx.Response, name: str, other_name: str) -> bool:
        return answer.status_code == other.status_code and answer.json() == orjson.loads(
            other.text.replace(other_name, name)
        )

    def attack() -> str:
        with abuse_stack.api(prober) as client:
            submitted = {
                name: client.post("/api/v1/jobs/", data={"model": name}, files={"file": ("a.jsonl", io.BytesIO(body))})
                for name in (hidden.name, "no-such-chat")
            }
            assert same(submitted[hidden.name], submitted["no-such-chat"], hidden.name, "no-such-chat"), submitted
            job = client.post("/api/v1/jobs/", data={"model": MODEL}, files={"file": ("a.jsonl", io.BytesIO(body))})
            assert job.status_code == 201, job.text
            reruns = {
                name: client.post(f"/api/v1/jobs/{job.json()['id']}/rerun/", json={"model": name})
                for name in (hidden.name, "no-such-chat")
            }
            assert reruns[hidden.name].status_code == 400, reruns[hidden.name].text
            assert same(reruns[hidden.name], reruns["no-such-chat"], hidden.name, "no-such-chat"), reruns
        return "submit and re-run naming a model outside the quota: 400, word for word as a model that does not exist"

    abuse_report("probing models outside the quota", attack)


def test_an_s3_key_that_climbs_out_of_the_tenants_prefix_is_refused(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    climber = abuse_stack.tenant("s3-climber")
    with abuse_stack.db():
        from portal.tenancy.models import Tenant

        Tenant.objects.filter(name="s3-climber").update(storage_prefixes=["s3://datasets/climber/"])
    uris = ["s3://datasets/climber/x?/../../victim/in.jsonl", "s3://datasets/climber/x#/../../victim/in.jsonl",
            "s3://datasets/climber/../victim/in.jsonl", "s3://datasets/climber/./in.jsonl"]  # fmt: skip

    def attack() -> str:
        with abuse_stack.api(climber) as client:
            for uri in uris:
                refused = client.post("/api/v1/jobs/", json={"model": MODEL, "input_uri": uri})
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert error["param"] == "input_uri" and "'.' or '..' segment" in error["message"], error
        return f"{len(uris)} s3:// keys with '..' after '?' or '#', or '.' segments: 400 naming input_uri"

    abuse_report("an S3 key out of the tenant's prefix", attack)


def test_a_removed_admins_invitation_cannot_be_accepted(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    owner = abuse_stack.tenant("inviters")
    admin = abuse_stack.member("inviters", "inviters-admin", role="admin")
    invitee = abuse_stack.tenant("invitee-home")

    def attack() -> str:
        with abuse_stack.api(admin) as client:
            invited = client.post("/api/v1/invitations/", json={"username": invitee.username, "role": "admin"})
            assert invited.status_code == 201, invited.text
        with abuse_stack.api(owner) as client:
            members = client.get("/api/v1/members/").json()
            rows = members["results"] if isinstance(members, dict) else members
            row = next(row for row in rows if row["username"] == admin.username)
            assert client.delete(f"/api/v1/members/{row['id']}/").status_code == 204
            listed = client.get("/api/v1/invitations/").json()
            listed = listed["results"] if isinstance(listed, dict) else listed
            assert [entry["status"] for entry in listed if entry["id"] == invited.json()["id"]] == ["revoked"]
        with _signed_in(abuse_stack, invitee) as browser:
            token = _csrf(browser, "/invitations/")
            accepted = browser.post(f"/invitations/{invited.json()['id']}/accept/", data={"csrfmiddlewaretoken": token})
            assert accepted.status_code < 500, accepted.text[:300]
        with abuse_stack.db():
            from portal.tenancy.models import Membership

            assert not Membership.objects.filter(user__username=invitee.username, tenant__name="inviters").exists()
        return "the removed admin's invitation: revoked, accepting it makes no membership"

    abuse_report("a removed admin's invitation", attack)


def test_an_operators_bulk_change_holds_from_the_next_request(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    admin = abuse_stack.tenant("bulk-changed", role="admin")

    def statuses(path: str) -> set[int]:
        with abuse_stack.api(admin) as client:
            return {client.get(path).status_code for _ in range(8)}

    def attack() -> str:
        assert statuses("/api/v1/members/") == {200}  # every portal worker keeps the key
        abuse_stack.manage(
            "shell", "-c", "from portal.tenancy.models import Membership as M; "
            f"M.objects.filter(user__username='{admin.username}').update(role='viewer')",
        )  # fmt: skip
        demoted = statuses("/api/v1/members/")
        abuse_stack.manage(
            "shell", "-c", "from django.utils import timezone; from portal.tenancy.models import ApiKey as K; "
            f"K.objects.filter(user__username='{admin.username}').update(revoked_at=timezone.now())",
        )  # fmt: skip
        revoked = statuses("/api/v1/jobs/")
        assert demoted == {403} and revoked == {401}, (demoted, revoked)
        return "role updated in bulk: 403 at once; keys revoked in bulk: 401 at once"

    abuse_report("an operator's bulk update and the key cache", attack)


def test_many_record_model_names_are_bounded(abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]) -> None:
    namer = abuse_stack.tenant("many-names")
    lines = scale(5_000, 100_000)
    body = _lines([{"custom_id": f"r{n}", "input": "x", "model": f"name-{n}"} for n in range(lines)])

    def attack() -> str:
        started = time.monotonic()
        with abuse_stack.api(namer, timeout_s=60) as client:
            answer = client.post("/api/v1/jobs/", data={"model": MODEL}, files={"file": ("m.jsonl", io.BytesIO(body))})
            took = time.monotonic() - started
            if answer.status_code == 201:  # past the submission's own check: the planner refuses it
                job = _ended(client, f"/api/v1/jobs/{answer.json()['id']}/", {"failed"})
                message = job["error"]
            else:
                assert answer.status_code == 400, answer.text[:300]
                message = answer.json()["error"]["message"]
        # Every line is named as bad (the first 20 in the message); past the 100th distinct name, each line is
        # refused naming BATCHERY_MAX_RECORD_MODEL_NAMES, with no lookup and no name kept (test_model_names.py).
        assert f"{lines} bad lines" in message and "neither the job's model" in message, message[:500]
        return f"{lines:,} distinct record model names: every line refused, named, in {took:.1f} s"

    abuse_report("many distinct record model names", attack)
