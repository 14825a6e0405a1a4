"""GEMM challenges on a gateway of several worker processes (issue 32).

Every worker sends its audit jobs to the first process's desk (`trust.audit_link`), and only the
first process's pool relays challenges. A miner holds a leg on each worker, and every one of its
legs has the same id (`MinerPool._leg_id` derives it from the miner and its hello), so the desk
finds the miner's leg in its own pool by the id another worker put on the job, and the miner,
whose record of an answer does not depend on the leg that carried it, opens it over that leg.

This runs `run_gateway` with `gateway.workers = 2` (this process is worker 0 and starts worker 1)
and a synthetic miner: each pool names its requests and challenges with a salt of its own
(`c<n>-<salt>`, `g<n>-<salt>`), and the synthetic miner files each commitment under the serving
request's id, so a challenge says which worker served the answer and which relayed it.
"""

from __future__ import annotations

import httpx
import trio

from engy_node.miner.link import Identity, LinkSettings
from engy_node.protocol.audit import LeasedJob
from engy_node.testing.synthetic_miner import Script, SyntheticHandler, synthetic_link
from engy_node.verifier.sources import HttpAuditSource
from tests.waiting import Changes, wait_until_async

from .test_gemm_relay import COMMITMENT, MODEL, NETUID, PICKS, gemm_gateway

FAST = LinkSettings(heartbeat_s=5, backoff_base_s=0.05, backoff_cap_s=0.2, reconnect_delay_s=0.05)
ROUNDS = 8
"""Rounds of buyer requests at most until both workers served one: each fresh connection goes to
either worker (SO_REUSEPORT), so eight rounds of eight all landing on one is a 2^-63 chance."""
PER_ROUND = 8


def salt(corr_id: str) -> str:
    """The pool that named a request (`c<n>-<salt>`) or a challenge (`g<n>-<salt>`)."""
    return corr_id.split("-")[1]


async def test_answers_served_by_any_worker_are_opened_through_the_first_processs_desk(
    nursery, tmp_path, checkpoint, alice
):
    urls, served, miner_key, buyer_key = await gemm_gateway(nursery, tmp_path, checkpoint, alice, workers=2)
    handler = SyntheticHandler(served, lambda frame: Script(gemm_commitment=COMMITMENT))
    async with httpx.AsyncClient(timeout=60) as http:
        link = synthetic_link(
            gateway_url=urls.miner_url,
            model=served,
            identity=Identity(miner_key=miner_key),
            handler=handler,
            http=http,
            settings=FAST,
            max_inflight=64,
            gemm_audits=True,
        )
        legs = Changes()
        link.on_state = legs.notify
        await nursery.start(link.run)
        await legs.wait_for(lambda: sum(link.legs_up.values()) >= 2, timeout_s=30, what="a leg up on each worker")

        async def ask(index: int) -> None:
            # A fresh connection per request: the kernel hands them to both workers.
            async with httpx.AsyncClient(timeout=60) as own:
                answer = await own.post(
                    urls.buyer_url + "/v1/chat/completions",
                    headers={"authorization": f"Bearer {buyer_key}"},
                    json={"model": MODEL, "messages": [{"role": "user", "content": f"q {index}"}], "max_tokens": 16},
                )
            assert answer.status_code == 200, answer.text

        for round_ in range(ROUNDS):
            async with trio.open_nursery() as buyers:
                for index in range(PER_ROUND):
                    buyers.start_soon(ask, round_ * PER_ROUND + index)
            if len({salt(frame.corr_id) for frame in handler.served}) == 2:
                break
        answered = len(handler.served)
        assert len({salt(frame.corr_id) for frame in handler.served}) == 2, "both workers served"
        assert all(frame.request.gemm_commitment for frame in handler.served), "every worker asks to commit"

        source = HttpAuditSource(urls.provider_url, keypair=alice, netuid=NETUID)
        try:
            leased: list[LeasedJob] = []

            async def all_leased() -> bool:
                # Worker 1's jobs reach the desk over the link a moment after their answers.
                leased.extend(await source.lease(64))
                return len(leased) >= answered

            await wait_until_async(all_leased, timeout_s=30, what="every answer leased as an audit job")
            assert len(leased) == answered
            for each in leased:
                job = each.job
                assert (job.gemm_asked, job.gemm_commitment) == (True, COMMITMENT)
                assert job.gemm_rid is None and job.leg_id == "", "the rid and the leg stay at the gateway"
                openings = await source.open_gemm(job.request_id, PICKS)
                assert [(o["position"], o["layer"], o["group"]) for o in openings] == [
                    (p.position, p.layer, p.group) for p in PICKS
                ], f"job {job.request_id} opened"
        finally:
            await source.aclose()

    assert len(handler.challenges) == answered
    relayed_by = {salt(challenge.challenge_id) for challenge in handler.challenges}
    served_by = {salt(challenge.rid) for challenge in handler.challenges}
    assert len(relayed_by) == 1, "only the first process's pool relays challenges"
    assert served_by - relayed_by, "answers another worker served were opened over the first process's leg"
    opened = sorted(challenge.rid.rsplit("-", 1)[0] for challenge in handler.challenges)
    assert opened == sorted(frame.corr_id for frame in handler.served), "each answer's record opened once"
