"""Audit jobs from another worker process's link reach the first process's desk (GEMM rid and
serving leg included), across a restart of the receiving end, and a backed-up link drops jobs
rather than blocking a worker."""

from __future__ import annotations

import dataclasses
import secrets
import time

import pytest
import trio
import trio.testing

from engy_node.gateway.store import Store
from engy_node.gateway.trust import audit_link
from engy_node.gateway.trust.audit import AuditQueue
from engy_node.gateway.trust.audit_desk import AuditDesk
from engy_node.gateway.trust.audit_link import AuditLinkClient, AuditLinkServer
from engy_node.proof import Delivery
from engy_node.protocol.audit import AuditJob
from engy_node.protocol.miner import Sampling


def job(request_id: str, *, found: tuple[str, str] | None = None) -> AuditJob:
    return AuditJob(
        request_id=request_id,
        model="smollm2-135m",
        miner="key:1",
        kind="paid",
        prompt_ids=tuple(range(500)),
        commitment={"output_token_ids": [1, 2, 3], "toploc": {"proofs": ["AAAA"] * 4}},
        greedy=False,
        sampling=Sampling(temperature=0.7, seed=5),
        seeded=True,
        delivery=Delivery((1, 2, 3), False, 16),
        created_at=time.time(),
        found=found,
        # What the first process's desk needs to relay a GEMM challenge for a job another worker
        # served, and which never goes on to a verifier.
        gemm_asked=True,
        gemm_commitment={"format": "engy-activations-v1", "activations_root": "cd" * 32, "positions": 503},
        gemm_rid=f"{request_id}-rid",
        leg_id="0f" * 16,
    )


@pytest.fixture
def desk(tmp_path):
    with Store.open(tmp_path / "gateway.sqlite3") as store:
        yield AuditDesk(queue=AuditQueue(), store=store)


async def wait_for(condition, timeout_s: float = 10.0) -> None:
    with trio.fail_after(timeout_s):
        while not condition():
            await trio.sleep(0.01)


async def test_jobs_offered_in_one_process_arrive_whole_at_the_desk(nursery, desk):
    token = secrets.token_hex(8)
    await nursery.start(AuditLinkServer(token, desk).run)
    await nursery.start(desk.run)
    client = AuditLinkClient(token)
    await nursery.start(client.run)
    for index in range(50):
        client.offer(job(f"r{index}"))
    client.offer(job("padded", found=("cheat", "usage-padding")))
    await wait_for(lambda: len(desk.queue) == 50 and desk.recorded == 1)
    arrived, _ = desk.queue.holder("r7", now=time.time())
    assert arrived == dataclasses.replace(job("r7"), created_at=arrived.created_at)
    assert desk.store.verdict("padded").reason == "usage-padding"


async def test_the_client_waits_for_the_first_process_and_reconnects(nursery, desk):
    token = secrets.token_hex(8)
    client = AuditLinkClient(token)
    await nursery.start(client.run)
    client.offer(job("early"))
    # Everything blocked: the client has found no first process and waits to dial again.
    await trio.testing.wait_all_tasks_blocked()
    with trio.CancelScope() as first_server:
        async with trio.open_nursery() as inner:
            await inner.start(AuditLinkServer(token, desk).run)
            await wait_for(lambda: len(desk.queue) == 1)
            first_server.cancel()
    client.offer(job("while-down"))
    await nursery.start(AuditLinkServer(token, desk).run)
    await wait_for(lambda: len(desk.queue) == 2, timeout_s=20)


async def test_a_backed_up_link_drops_jobs_instead_of_blocking(monkeypatch):
    monkeypatch.setattr(audit_link, "QUEUE_JOBS", 3)
    client = AuditLinkClient(secrets.token_hex(8))
    for index in range(5):
        client.offer(job(f"r{index}"))
    assert client.dropped == 2
