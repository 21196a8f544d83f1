"""Attacks on the lanes every tenant shares: a webhook receiver that trickles, a flood of batch
validations, a flood of webhook endpoints, and webhook URLs that smuggle a private IPv4 address
inside an IPv6 one."""

from __future__ import annotations

import io
import time
from collections.abc import Callable

import orjson
import pytest
import redis

from tests.abuse.conftest import scale
from tests.support.abuse import MODEL, AbuseResult, AbuseStack
from tests.webhooks.conftest import Receiver, TrickleReceiver

pytestmark = [pytest.mark.slow, pytest.mark.abuse]

DEADLINE_S = 5.0
"""BATCHERY_WEBHOOK_ATTEMPT_DEADLINE_S of the stack."""


def test_a_trickling_receiver_delays_nothing_but_its_own_tenants_deliveries(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    attacker = abuse_stack.tenant("trickler", max_concurrent_jobs=100)
    victim = abuse_stack.tenant("victim")
    slow, fast = TrickleReceiver(), Receiver([])
    jobs = scale(4, 12)
    small = b"".join(orjson.dumps({"custom_id": f"t{n}", "input": f"t {n}"}) + b"\n" for n in range(3))
    with abuse_stack.api(attacker) as client:
        hostile = client.post(
            "/api/v1/webhooks/",
            json={"url": slow.url("/hook/tok-SECRET39?key=SECRET39"), "event_types": ["job.completed"]},
        )
    with abuse_stack.api(victim) as client:
        honest = client.post("/api/v1/webhooks/", json={"url": fast.url, "event_types": ["job.completed"]})
    assert hostile.status_code == 201 and honest.status_code == 201, (hostile.text, honest.text)

    def attack() -> str:
        with abuse_stack.api(attacker) as client:
            for n in range(jobs):
                made = client.post(
                    "/api/v1/jobs/", data={"model": MODEL}, files={"file": (f"{n}.jsonl", io.BytesIO(small))}
                )
                assert made.status_code == 201, made.text
        slow.wait_for_connections(2, timeout_s=60)
        # The victim's job (submitted meanwhile) ends, and its tenant hears of it while the trickle goes on.
        fast.wait_for(1, timeout_s=30)
        deadline = time.monotonic() + 60
        with abuse_stack.db():
            from portal.webhooks.models import WebhookAttempt

            attempts = WebhookAttempt.objects.filter(delivery__endpoint_id=hostile.json()["id"])
            while attempts.count() < 2:
                assert time.monotonic() < deadline, "no attempt of the trickled deliveries ended"
                time.sleep(0.5)
            ended = list(attempts)
        assert all(a.status_code is None and "BATCHERY_WEBHOOK_ATTEMPT_DEADLINE_S" in a.error for a in ended), ended
        assert max(a.duration_ms for a in ended) <= (DEADLINE_S + 2) * 1000, [a.duration_ms for a in ended]
        assert "SECRET39" not in abuse_stack.workers["webhooks"].log_path.read_text(errors="replace")
        longest = max(a.duration_ms for a in ended) / 1000
        return (
            f"{len(ended)} attempts cut at the {DEADLINE_S:.0f} s deadline (longest {longest:.1f} s); "
            "the victim's webhook arrived meanwhile; the URL's token in no log"
        )

    try:
        abuse_report("a webhook receiver trickling a byte a second", attack, lead_s=1.0)
    finally:
        with abuse_stack.api(attacker) as client:
            client.delete(f"/api/v1/webhooks/{hostile.json()['id']}/")
        with abuse_stack.api(victim) as client:
            client.delete(f"/api/v1/webhooks/{honest.json()['id']}/")
        slow.stop()
        fast.stop()


def test_a_flood_of_batches_on_one_file_is_held_to_the_concurrent_jobs_quota(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    attacker = abuse_stack.tenant("batch-flooder", max_concurrent_jobs=2)
    lines = b"".join(
        orjson.dumps({"custom_id": f"b{n}", "method": "POST", "url": "/v1/embeddings",
                      "body": {"model": MODEL, "input": f"sentence {n}"}}) + b"\n"
        for n in range(200)
    )  # fmt: skip
    creates = scale(50, 500)
    broker = redis.Redis.from_url(abuse_stack.broker_url)
    with abuse_stack.api(attacker) as client:
        uploaded = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", io.BytesIO(lines))})
    assert uploaded.status_code == 200, uploaded.text
    request = {"input_file_id": uploaded.json()["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}

    def attack() -> str:
        statuses = []
        # Validating takes its time on a large file: the validation worker is held still so that the first
        # batches stay validating for the whole flood.
        with abuse_stack.paused("validation"), abuse_stack.api(attacker) as client:
            for _ in range(creates):
                answer = client.post("/v1/batches", json=request)
                statuses.append(answer.status_code)
                if answer.status_code == 429:
                    error = answer.json()["error"]
                    assert error["code"] == "quota_exceeded" and error["param"] == "max_concurrent_jobs", error
            control = [message for message in broker.lrange("control", 0, -1) if b"validate_batch" in message]
            for batch in client.get("/v1/batches").json()["data"]:
                client.post(f"/v1/batches/{batch['id']}/cancel")
        assert statuses == [200, 200] + [429] * (creates - 2), statuses
        assert control == []
        return f"{creates} batches on one file: 2 validating, then 429 max_concurrent_jobs; none on the control queue"

    abuse_report("a flood of batches on one file", attack)


def test_endpoint_floods_and_ipv6_forms_of_private_addresses_are_refused(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    flooder = abuse_stack.tenant("endpoint-flooder")
    prober = abuse_stack.tenant("ssrf-prober")
    smuggled = {
        "127.0.0.1": ["::127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::1", "2001:0:4136:e378:8000:63bf:80ff:fffe"],
        "10.0.0.1": ["::10.0.0.1", "64:ff9b::a00:1", "2002:a00:1::1", "2001:0:4136:e378:8000:63bf:f5ff:fffe"],
        "169.254.169.254": [
            "::169.254.169.254", "64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1", "2001:0:4136:e378:8000:63bf:5601:5601",
        ],
    }  # fmt: skip

    def attack() -> str:
        with abuse_stack.api(flooder) as client:
            flood = [
                client.post("/api/v1/webhooks/", json={"url": f"https://93.184.215.14/hook{n}"}).status_code
                for n in range(10)
            ]
            over = client.post("/api/v1/webhooks/", json={"url": "https://93.184.215.14/one-more"}).json()["error"]
        assert flood == [201] * 5 + [400] * 5, flood
        assert over["param"] == "url" and "BATCHERY_WEBHOOK_MAX_ENDPOINTS_PER_TENANT" in over["message"], over
        refused = 0
        with abuse_stack.api(prober) as client:
            for carried, addresses in smuggled.items():
                for address in addresses:
                    answer = client.post("/api/v1/webhooks/", json={"url": f"http://[{address}]/hook"})
                    assert answer.status_code == 400, (address, answer.text)
                    assert carried in answer.json()["error"]["message"], (address, answer.text)
                    refused += 1
            for address in ("::ffff:127.0.0.1", "64:ff9b:1::5db8:d70e"):
                assert client.post("/api/v1/webhooks/", json={"url": f"http://[{address}]/hook"}).status_code == 400
                refused += 1
            public = [
                client.post("/api/v1/webhooks/", json={"url": f"http://[{address}]/hook"}).status_code
                for address in ("64:ff9b::5db8:d70e", "2002:5db8:d70e::1")
            ]
        assert public == [201, 201], public
        return (
            f"endpoints past 5: 400 naming the setting; {refused} IPv6 forms of loopback, private and metadata "
            "addresses: 400 naming the IPv4 they carry; public ones accepted"
        )

    abuse_report("endpoint flood and IPv6 SSRF", attack)
