"""Verdicts in the live path, with the public miner's habits: a miner whose proof covers another
prompt than the buyer's has its answer refused before delivery ends and not charged, and leaves
the pool although the gateway runs without qualification (a private gateway, where nothing else
would pull it); an answer the gateway cuts at a stop string the miner ignores stays provable,
judged on the miner's commitment rather than left unproven by the cut; and a miner whose text
loses spaces and a held-back tail against the tokens it proved has a defect, not a cheat: the
buyer gets the proven text and pays for it, and the miner stays in the pool."""

from __future__ import annotations

import os

import httpx
import openai
import pytest
import trio

from engy_node.config import load_config
from engy_node.gateway.role import store_path
from engy_node.gateway.store import Store
from engy_node.models import SMOLLM2_135M
from engy_node.serve.client import ServeClient
from engy_node.served_model import load_served_model

from .public_peer import PublicMiner
from .test_public_miner import MODEL, QUESTION, StoppableGateway, buyer, openai_client

SKY = [{"role": "user", "content": "Explain why the sky is blue in two sentences."}]
"""Its first sentence ends well before 48 tokens, and the public miner goes on past the stop."""


def another_prompt(prompt_ids: list[int]) -> list[int]:
    return [*prompt_ids[:-1], (prompt_ids[-1] + 1) % 1000]


async def public_network(nursery, home, checkpoint, reference_server, http, *, gateway: dict, **miner):
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(
        home=home,
        env=env,
        overrides={"gateway": {"port": 0, "miner_port": 0, "provider_port": 0, "qualification": False, **gateway}},
    )
    urls = await nursery.start(StoppableGateway().run, config)
    store = Store.open(store_path(config))
    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    _, miner_key = store.register_miner("public-miner")
    peer = PublicMiner(
        url=urls.miner_url,
        miner_key=miner_key,
        model=served,
        serve=ServeClient(reference_server.url, http),
        heartbeat_s=0.5,
        **miner,
    )
    await nursery.start(peer.run)
    return urls, store, peer


@pytest.fixture
async def gateway(nursery, tmp_path, checkpoint, reference_server):
    async with httpx.AsyncClient(timeout=120) as http:
        urls, store, _ = await public_network(
            nursery,
            tmp_path,
            checkpoint,
            reference_server,
            http,
            gateway={"queue_wait_s": 0.5},
            proved_prompt=another_prompt,
        )
        yield urls, store
    store.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_proven_for_another_prompt_is_refused_uncharged_and_its_miner_leaves_the_pool(gateway, stream):
    urls, store = gateway
    account, key = buyer(store)
    before = store.balance(account)
    client = openai_client(urls, key)

    def ask() -> str:
        if not stream:
            return (
                client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16).choices[0].message.content
            )
        return "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, stream=True)
            if chunk.choices
        )

    with pytest.raises(openai.APIError) as refused:
        await trio.to_thread.run_sync(ask)
    assert "failed verification" in str(refused.value)
    assert store.balance(account) == before, "the refused answer was charged"

    # The gateway's own finding is a cheat verdict; within a refresh the miner is out of the pool.
    with trio.fail_after(30):
        while True:
            try:
                await trio.to_thread.run_sync(ask)
            except openai.APIError as error:
                if getattr(error, "status_code", None) in (503, 529):
                    break
            await trio.sleep(0.5)
    assert store.balance(account) == before


async def test_an_answer_cut_at_a_stop_string_the_miner_ignores_is_judged_on_its_commitment(
    nursery, tmp_path, checkpoint, reference_server
):
    async with httpx.AsyncClient(timeout=120) as http:
        urls, store, miner = await public_network(
            nursery,
            tmp_path,
            checkpoint,
            reference_server,
            http,
            gateway={"audit_paid_pct": 100, "local_verifier": True},
        )
        try:
            _, key = buyer(store)
            client = openai_client(urls, key)

            def ask() -> str:
                return "".join(
                    chunk.choices[0].delta.content or ""
                    for chunk in client.chat.completions.create(
                        model=MODEL, messages=SKY, max_tokens=48, stream=True, stop=["."]
                    )
                    if chunk.choices
                )

            text = await trio.to_thread.run_sync(ask)
            assert text and "." not in text and miner.served, "the gateway did not cut the answer at the stop string"
            with trio.fail_after(120):
                while not (verdicts := store.verdicts_after(0)):
                    await trio.sleep(0.2)
            [(_, record)] = verdicts
            assert (record.verdict, record.reason) == ("pass", "ok"), "judged on its TOPLOC commitment, and passed"
        finally:
            store.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_miner_whose_text_differs_from_its_proof_in_presentation_has_a_defect_and_the_buyer_gets_the_proof(
    nursery, tmp_path, checkpoint, reference_server, stream
):
    async with httpx.AsyncClient(timeout=120) as http:
        urls, store, miner = await public_network(
            nursery,
            tmp_path,
            checkpoint,
            reference_server,
            http,
            gateway={"audit_paid_pct": 100, "local_verifier": True},
            shown=lambda text: text.replace("of France", "ofFrance"),
            held_back_chars=4,
        )
        try:
            account, key = buyer(store)
            before = store.balance(account)
            client = openai_client(urls, key)

            def ask():
                if not stream:
                    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24)
                    return reply.choices[0].message.content, reply.usage.completion_tokens
                chunks = list(
                    client.chat.completions.create(
                        model=MODEL,
                        messages=QUESTION,
                        max_tokens=24,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
                text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
                return text, chunks[-1].usage.completion_tokens

            text, completion_tokens = await trio.to_thread.run_sync(ask)
            served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
            prompt = served.tokenizer.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True)
            proven = (
                await ServeClient(reference_server.url, http).generate_once(
                    list(prompt if isinstance(prompt, list) else prompt["input_ids"]),
                    {"temperature": 0.0, "max_new_tokens": 24},
                    rid="proof-of-the-test",
                )
            )["text"]
            assert "of France" in proven and len(proven) > 4, "the fixture needs the bug to show"
            if stream:
                assert "ofFrance" in text and text.replace("ofFrance", "of France") == proven, (
                    "the held-back tail is sent from the proven text"
                )
            else:
                assert text == proven, "a whole answer is the proven text"
            assert store.balance(account).charged > before.charged and completion_tokens > 0, "the answer is charged"
            with trio.fail_after(120):
                while not (verdicts := store.verdicts_after(0)):
                    await trio.sleep(0.2)
            [(_, record)] = verdicts
            assert (record.verdict, record.reason) == ("pass", "defect:whitespace")
            assert store.defect_counts(since=0.0, until=2e9) == {record.miner: 1}
        finally:
            store.close()
