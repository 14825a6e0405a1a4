"""The provider API on real hypercorn: the signed audit API's rules, bad input refused with
nothing changed, published epochs served byte for byte, validator heartbeats."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest
import trio
from hypercorn.config import Config as HypercornConfig

from engy_node import keys
from engy_node.asgi import start_listener
from engy_node.gateway.store import Store
from engy_node.gateway.trust.audit import AuditQueue
from engy_node.gateway.trust.audit_desk import AuditDesk
from engy_node.gateway.trust.provider_api import MAX_BODY_BYTES, PREFIX, ProviderApi, build_provider_app
from engy_node.proof import Delivery
from engy_node.protocol.audit import AuditJob
from engy_node.protocol.miner import Sampling

NETUID = 53
LEASE = f"{PREFIX}/audit/lease"
VERDICTS = f"{PREFIX}/audit/verdicts"
HEARTBEAT = f"{PREFIX}/validator/heartbeat"


def job(request_id: str, *, kind: str = "paid") -> AuditJob:
    return AuditJob(
        request_id=request_id,
        model="smollm2-135m",
        miner="5MinerHotkey",
        kind=kind,
        prompt_ids=(1, 2, 3),
        commitment={"output_token_ids": [4]},
        greedy=True,
        sampling=Sampling(),
        seeded=False,
        delivery=Delivery(relayed_output_ids=(4,), ended_at_stop=False, max_tokens=8),
        created_at=time.time(),
    )


class Provider:
    def __init__(self, url: str, store: Store, desk: AuditDesk) -> None:
        self.url = url
        self.store = store
        self.desk = desk
        self.client = httpx.AsyncClient(timeout=10)

    async def signed(
        self,
        keypair,
        path: str,
        body: object,
        *,
        ts: int | None = None,
        raw: bytes | None = None,
        headers: dict | None = None,
    ) -> httpx.Response:
        content = raw if raw is not None else orjson.dumps(body)
        signed = keys.signed_headers(keypair, NETUID, "POST", path, content, int(time.time()) if ts is None else ts)
        return await self.client.post(self.url + path, content=content, headers={**signed, **(headers or {})})

    async def lease(self, keypair, max_jobs: int = 8) -> list[dict]:
        response = await self.signed(keypair, LEASE, {"max_jobs": max_jobs})
        assert response.status_code == 200, response.text
        return response.json()["jobs"]

    async def verdicts(self, keypair, *items: tuple[str, str, str]) -> httpx.Response:
        return await self.signed(
            keypair, VERDICTS, {"verdicts": [{"job_id": j, "verdict": v, "reason": r} for j, v, r in items]}
        )


@pytest.fixture
async def provider(nursery, tmp_path, alice):
    store = Store.open(tmp_path / "gateway.sqlite3")
    desk = AuditDesk(queue=AuditQueue(lease_s=60.0), store=store)

    async def current() -> dict:
        return {"v": 1, "epoch_index": 7, "final": False}

    api = ProviderApi(
        desk=desk, store=store, netuid=NETUID, verifiers=frozenset({alice.ss58_address}), current_epoch=current
    )
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    binds = await start_listener(nursery, build_provider_app(api), config, what="provider API", flag="test")
    provider = Provider(binds[0], store, desk)
    yield provider
    await provider.client.aclose()
    store.close()


def error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


async def test_a_verifier_leases_judges_and_the_verdict_is_filed_under_the_serving_miner(provider, alice):
    provider.desk.offer(job("req-1"))
    provider.desk.offer(job("req-2", kind="probe"))
    jobs = await provider.lease(alice)
    assert [j["job_id"] for j in jobs] == ["req-1", "req-2"]
    assert all("miner" not in j and "kind" not in j for j in jobs)
    assert all(0 < j["lease_expires_in_s"] <= 60 for j in jobs)
    response = await provider.verdicts(alice, ("req-1", "pass", "ok"), ("req-2", "cheat", "chunks"))
    assert response.status_code == 200
    assert response.json() == {
        "results": [{"job_id": "req-1", "status": "recorded"}, {"job_id": "req-2", "status": "recorded"}]
    }
    stored = provider.store.verdict("req-2")
    assert (stored.miner, stored.kind, stored.verdict, stored.reason, stored.verifier) == (
        "5MinerHotkey",
        "probe",
        "cheat",
        "chunks",
        alice.ss58_address,
    )
    assert len(provider.desk.queue) == 0, "a judged job's proof material is dropped"


async def test_posting_the_same_verdict_again_is_acknowledged_and_changes_nothing(provider, alice):
    provider.desk.offer(job("req-1"))
    await provider.lease(alice)
    assert (await provider.verdicts(alice, ("req-1", "pass", "ok"))).status_code == 200
    again = await provider.verdicts(alice, ("req-1", "pass", "ok"))
    assert again.status_code == 200 and again.json()["results"][0]["status"] == "duplicate"
    assert provider.store.verdicts_after(0) == provider.store.verdicts_after(0)[:1]


async def test_a_different_verdict_for_a_judged_job_is_refused(provider, alice):
    provider.desk.offer(job("req-1"))
    await provider.lease(alice)
    await provider.verdicts(alice, ("req-1", "pass", "ok"))
    response = await provider.verdicts(alice, ("req-1", "cheat", "chunks"))
    assert response.status_code == 409 and error_code(response) == "already_judged"
    assert provider.store.verdict("req-1").verdict == "pass"


async def test_a_batch_with_one_bad_verdict_records_none_of_it(provider, alice):
    provider.desk.offer(job("req-1"))
    await provider.lease(alice)
    response = await provider.verdicts(alice, ("req-1", "pass", "ok"), ("nobody-offered-this", "pass", "ok"))
    assert response.status_code == 404 and error_code(response) == "unknown_job"
    assert provider.store.verdict("req-1") is None and len(provider.desk.queue) == 1


async def test_verdicts_only_for_jobs_you_hold(provider, alice, bob):
    provider.desk.offer(job("req-1"))
    not_leased = await provider.verdicts(alice, ("req-1", "pass", "ok"))
    assert not_leased.status_code == 409 and error_code(not_leased) == "not_leased"
    provider.desk.lease(bob.ss58_address, limit=1)
    elsewhere = await provider.verdicts(alice, ("req-1", "pass", "ok"))
    assert elsewhere.status_code == 409 and error_code(elsewhere) == "leased_elsewhere"
    assert provider.store.verdict("req-1") is None


@pytest.mark.parametrize(
    "body, message",
    [
        ({"verdicts": "pass"}, "the body must be"),
        ({"verdicts": []}, "post 1 to"),
        ({"verdicts": [{"job_id": "req-1", "verdict": "maybe", "reason": "ok"}]}, "verdict must be"),
        ({"verdicts": [{"job_id": "req-1", "verdict": "pass", "reason": "free text with spaces"}]}, "short code"),
        ({"verdicts": [{"job_id": "req-1", "verdict": "pass", "reason": "ok"}] * 2}, "appears twice"),
        ({"max_jobs": 0}, "the body must be"),
    ],
)
async def test_malformed_verdict_batches_are_refused_with_the_reason(provider, alice, body, message):
    provider.desk.offer(job("req-1"))
    await provider.lease(alice)
    response = await provider.signed(alice, VERDICTS, body)
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert provider.store.verdict("req-1") is None


@pytest.mark.parametrize("max_jobs", [0, 65, "4", True, None])
async def test_a_lease_size_outside_1_to_64_is_refused(provider, alice, max_jobs):
    response = await provider.signed(alice, LEASE, {"max_jobs": max_jobs})
    assert response.status_code == 400 and "max_jobs" in response.json()["error"]["message"]


async def test_unsigned_forged_stale_and_replayed_calls_are_refused(provider, alice, bob):
    provider.desk.offer(job("req-1"))
    unsigned = await provider.client.post(provider.url + LEASE, json={"max_jobs": 1})
    assert unsigned.status_code == 401 and error_code(unsigned) == "missing-header"
    forged = await provider.signed(bob, LEASE, {"max_jobs": 1}, headers={keys.HEADER_HOTKEY: alice.ss58_address})
    assert forged.status_code == 401 and error_code(forged) == "bad-signature"
    stale = await provider.signed(alice, LEASE, {"max_jobs": 1}, ts=int(time.time()) - 3600)
    assert stale.status_code == 401 and error_code(stale) == "stale"
    content = orjson.dumps({"max_jobs": 1})
    headers = keys.signed_headers(alice, NETUID, "POST", LEASE, content, int(time.time()))
    first = await provider.client.post(provider.url + LEASE, content=content, headers=headers)
    replayed = await provider.client.post(provider.url + LEASE, content=content, headers=headers)
    assert first.status_code == 200 and replayed.status_code == 401 and error_code(replayed) == "replay"
    other_path = keys.signed_headers(alice, NETUID, "POST", VERDICTS, content, int(time.time()))
    moved = await provider.client.post(provider.url + LEASE, content=content, headers=other_path)
    assert moved.status_code == 401 and error_code(moved) == "bad-signature"


async def test_a_hotkey_off_the_allow_list_is_refused_and_leases_nothing(provider, bob, alice):
    provider.desk.offer(job("req-1"))
    response = await provider.signed(bob, LEASE, {"max_jobs": 1})
    assert response.status_code == 403 and error_code(response) == "not_a_verifier"
    assert "gateway.verifiers" in response.json()["error"]["message"]
    assert [j["job_id"] for j in await provider.lease(alice)] == ["req-1"]


async def test_oversized_and_non_json_bodies_are_refused(provider, alice):
    big = await provider.signed(alice, LEASE, None, raw=b" " * (MAX_BODY_BYTES + 1))
    assert big.status_code == 413
    garbage = await provider.signed(alice, LEASE, None, raw=b"{not json")
    assert garbage.status_code == 400 and "not valid JSON" in garbage.json()["error"]["message"]
    listed = await provider.signed(alice, LEASE, [1, 2])
    assert listed.status_code == 400


async def test_epochs_are_served_byte_for_byte_once_published(provider):
    latest = await provider.client.get(provider.url + f"{PREFIX}/epoch/latest")
    assert latest.status_code == 404 and error_code(latest) == "no_epoch"
    payload_3, payload_4 = b'{"v":1,"epoch_index":3}', b'{"v":1,"epoch_index":4}'
    provider.store.save_epoch(3, payload_3, "a" * 64, closed_at=1.0)
    provider.store.save_epoch(4, payload_4, "b" * 64, closed_at=2.0)
    assert (await provider.client.get(provider.url + f"{PREFIX}/epoch/latest")).content == payload_4
    assert (await provider.client.get(provider.url + f"{PREFIX}/epoch/3")).content == payload_3
    assert (await provider.client.get(provider.url + f"{PREFIX}/epoch/5")).status_code == 404
    assert (await provider.client.get(provider.url + f"{PREFIX}/epoch/-1")).status_code == 400
    assert (await provider.client.get(provider.url + f"{PREFIX}/epoch/current")).json() == {
        "v": 1,
        "epoch_index": 7,
        "final": False,
    }


async def test_unknown_routes_and_methods_answer_json(provider):
    missing = await provider.client.get(provider.url + "/api/subnet/v1/nothing")
    assert missing.status_code == 404 and error_code(missing) == "not_found"
    wrong = await provider.client.get(provider.url + LEASE)
    assert wrong.status_code == 405 and error_code(wrong) == "method_not_allowed"


async def test_a_validator_heartbeat_is_kept_per_hotkey(provider, bob):
    digest = "c" * 64
    body = {"v": 1, "version": "engy-lv 0.4.4", "synced_epoch": 12, "consensus": {"epoch_index": 12, "digest": digest}}
    assert (await provider.signed(bob, HEARTBEAT, body)).status_code == 200
    [beat] = provider.store.validator_heartbeats()
    assert (beat.hotkey, beat.version, beat.synced_epoch, beat.consensus_epoch, beat.consensus_digest) == (
        bob.ss58_address,
        "engy-lv 0.4.4",
        12,
        12,
        digest,
    )
    bad = await provider.signed(bob, HEARTBEAT, {**body, "consensus": {"epoch_index": 12, "digest": "XYZ"}})
    assert bad.status_code == 400 and "digest" in bad.json()["error"]["message"]
    unsigned = await provider.client.post(provider.url + HEARTBEAT, json=body)
    assert unsigned.status_code == 401
    assert provider.store.validator_heartbeats() == [beat]
    await trio.lowlevel.checkpoint()
