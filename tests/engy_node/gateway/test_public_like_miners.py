"""Miners that behave like the public ones on the wire stay paid when honest and are pulled when
not, through the real gateway, its local verifier and the breaker on short local clocks.

Each peer (`public_peer.TeeLikeMiner`) sends the public frames, `commitment: {}`, streamed text
with a held-back tail stripped from its final text, and ignores stop strings and sampling; it
generates in bf16 while the verifier recomputes in fp32. The honest one serves the canonical
weights and must stay `active`, with no `cheat`, over at least 50 audited answers (its probes
and paid requests, greedy and sampled, streamed and not, some cut by the gateway at a stop
string); the same miner on 4-bit weights is pulled.
"""

from __future__ import annotations

import json
import os

import pytest
import trio

from engy_node import calibration
from engy_node.config import load_config
from engy_node.gateway.role import store_path
from engy_node.gateway.store import Store
from engy_node.models import SMOLLM2_135M
from engy_node.served_model import load_served_model

from .public_peer import TeeLikeMiner
from .test_public_miner import MODEL, StoppableGateway, buyer, openai_client
from .test_trust_pipeline import wait_until

AUDITED = 50
QUESTIONS = (
    "What is the capital of {}?",
    "Name one famous dish from {}.",
    "In one sentence, what is {} known for?",
    "What language is spoken in {}?",
)
COUNTRIES = (
    "France",
    "Italy",
    "Spain",
    "Japan",
    "Egypt",
    "Peru",
    "Kenya",
    "Norway",
    "Chile",
    "Greece",
    "Poland",
    "Mexico",
)


@pytest.fixture
def one_thread():
    """Both peers' decoding and the verifier's recompute share two cores; one torch thread each
    keeps them from spinning against each other."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.minutes
async def test_an_honest_public_like_miner_stays_active_and_a_four_bit_one_is_pulled(
    nursery, tmp_path, checkpoint, runner, one_thread
):
    corpus = tmp_path / "probes.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q.format(c)}]}) + "\n"
            for q in QUESTIONS
            for c in COUNTRIES[:4]
        )
    )
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(
        home=tmp_path,
        env=env,
        overrides={
            "gateway": {
                "port": 0,
                "miner_port": 0,
                "provider_port": 0,
                "qualify_probes": 3,
                "traffic_time_scale": 0.1,
                "probe_max_tokens": 24,
                "probe_concurrency": 2,
                "probe_corpus": str(corpus),
                "audit_paid_pct": 100.0,
                "local_verifier": True,
                # Both miners compute on this machine's CPU beside the other workers' model passes,
                # where a first token can take longer than the 15 s meant for a GPU: this test is
                # about verdicts, and a 504 would count against the honest miner's acceptance.
                "first_byte_wait_s": 120.0,
            }
        },
    )
    urls = await nursery.start(StoppableGateway().run, config)
    store = Store.open(store_path(config))
    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    quantised = await trio.to_thread.run_sync(
        lambda: calibration.quantise_linear_weights(type(runner).load(checkpoint, device="cpu", dtype="bfloat16"))
    )
    identity = {}
    for name, model in (("honest", runner), ("four-bit", quantised)):
        miner_id, miner_key = store.register_miner(name)
        identity[name] = f"key:{miner_id}"
        peer = TeeLikeMiner(
            url=urls.miner_url,
            miner_key=miner_key,
            model=served,
            heartbeat_s=0.5,
            runner=model,
            lock=trio.Lock(),
            held_back_chars=3,
        )
        await nursery.start(peer.run)

    def verdicts_of(name: str) -> list:
        return [record for _, record in store.verdicts_after(0) if record.miner == identity[name]]

    def state_of(name: str) -> str | None:
        return next((row.state for row in store.eligibility() if row.miner == identity[name]), None)

    async def qualified() -> bool:
        return state_of("honest") == "active" and state_of("four-bit") == "pulled"

    try:
        await wait_until(
            qualified,
            timeout_s=600,
            what=lambda: (
                f"honest active, four-bit pulled: {store.eligibility()} "
                f"{[(r.miner, r.verdict, r.reason) for _, r in store.verdicts_after(0)]}"
            ),
        )
        assert [r.reason for r in verdicts_of("four-bit") if r.verdict == "cheat"], (
            "the 4-bit miner is pulled on a cheat verdict"
        )

        _, key = buyer(store)
        client = openai_client(urls, key)

        def ask(index: int) -> None:
            question = QUESTIONS[index % len(QUESTIONS)].format(COUNTRIES[index % len(COUNTRIES)])
            sampled = {"temperature": 0.8} if index % 3 == 1 else {}
            stop = {"stop": ["."]} if index % 4 == 2 else {}
            messages = [{"role": "user", "content": question}]
            if index % 2:
                for _ in client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=24, stream=True, **sampled, **stop
                ):
                    pass
            else:
                client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, **sampled, **stop)

        index = 0
        while len(verdicts_of("honest")) < AUDITED:
            assert state_of("honest") == "active", f"the honest miner was pulled: {store.eligibility()}"
            await trio.to_thread.run_sync(ask, index)
            index += 1
            assert index < 4 * AUDITED, f"answers are not being audited: {len(verdicts_of('honest'))} verdicts"
        judged = verdicts_of("honest")
        assert not [r for r in judged if r.verdict == "cheat"], [(r.verdict, r.reason) for r in judged]
        assert all(r.reason.startswith("recompute:") for r in judged), "judged by recompute: it sends no commitment"
        assert state_of("honest") == "active"
    finally:
        store.close()
