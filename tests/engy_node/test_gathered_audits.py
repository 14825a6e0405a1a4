"""A verifier gathers audit jobs from every host of a gateway fleet: two hosts' provider APIs on
real hypercorn over one PostgreSQL store, each with the jobs of the responses it served; leased
from both, each verdict filed back through the host that leased it, and a host that is down costs
only its own jobs."""

from __future__ import annotations

import time

import pytest
from hypercorn.config import Config as HypercornConfig

from engy_node.asgi import start_listener
from engy_node.gateway.store import Store
from engy_node.gateway.trust.audit import AuditQueue
from engy_node.gateway.trust.audit_desk import AuditDesk
from engy_node.gateway.trust.provider_api import ProviderApi, build_provider_app
from engy_node.proof import Delivery
from engy_node.protocol.audit import AuditJob, PostedVerdict
from engy_node.protocol.miner import Sampling
from engy_node.verifier.sources import AuditCallFailed, GatheredAuditSource, HttpAuditSource

NETUID = 53


def job(request_id: str) -> AuditJob:
    return AuditJob(
        request_id=request_id,
        model="smollm2-135m",
        miner="5MinerHotkey",
        kind="paid",
        prompt_ids=(1, 2, 3),
        commitment={"output_token_ids": [4]},
        greedy=True,
        sampling=Sampling(),
        seeded=False,
        delivery=Delivery(relayed_output_ids=(4,), ended_at_stop=False, max_tokens=8),
        created_at=time.time(),
    )


async def provider_host(nursery, store: Store, alice) -> tuple[str, AuditDesk]:
    desk = AuditDesk(queue=AuditQueue(lease_s=60.0), store=store)

    async def current() -> dict:
        return {"v": 1, "epoch_index": 0, "final": False}

    api = ProviderApi(
        desk=desk, store=store, netuid=NETUID, verifiers=frozenset({alice.ss58_address}), current_epoch=current
    )
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    binds = await start_listener(nursery, build_provider_app(api), config, what="provider API", flag="test")
    return binds[0], desk


@pytest.fixture
def fleet_store(postgres_url):
    stores = [Store(postgres_url), Store(postgres_url)]
    yield stores
    for store in stores:
        store.close()


async def test_a_verifier_gathers_jobs_from_every_host_and_files_each_verdict_where_it_leased(
    nursery, fleet_store, alice
):
    (url_a, desk_a), (url_b, desk_b) = [await provider_host(nursery, store, alice) for store in fleet_store]
    desk_a.offer(job("served-by-a-1"))
    desk_a.offer(job("served-by-a-2"))
    desk_b.offer(job("served-by-b-1"))
    source = GatheredAuditSource([HttpAuditSource(url, keypair=alice, netuid=NETUID) for url in (url_a, url_b)])
    leased = await source.lease(8)
    assert sorted(j.job.request_id for j in leased) == ["served-by-a-1", "served-by-a-2", "served-by-b-1"]
    await source.post([PostedVerdict(job_id=j.job.request_id, verdict="pass", reason="ok") for j in leased])
    assert len(desk_a.queue) == 0 and len(desk_b.queue) == 0, "each host took the verdicts on its own jobs"
    for request_id in ("served-by-a-1", "served-by-b-1"):
        assert fleet_store[0].verdict(request_id).verdict == "pass", "both hosts' verdicts land in the one store"
    await source.aclose()


async def test_a_host_that_is_down_costs_only_its_own_jobs(nursery, fleet_store, alice):
    url_a, desk_a = await provider_host(nursery, fleet_store[0], alice)
    desk_a.offer(job("served-by-a"))
    down = HttpAuditSource("http://127.0.0.1:1", keypair=alice, netuid=NETUID)
    source = GatheredAuditSource([down, HttpAuditSource(url_a, keypair=alice, netuid=NETUID)])
    assert [j.job.request_id for j in await source.lease(4)] == ["served-by-a"]
    await source.aclose()
    nowhere = GatheredAuditSource([HttpAuditSource("http://127.0.0.1:1", keypair=alice, netuid=NETUID)])
    with pytest.raises(AuditCallFailed, match="cannot reach"):
        await nowhere.lease(4)
    await nowhere.aclose()
