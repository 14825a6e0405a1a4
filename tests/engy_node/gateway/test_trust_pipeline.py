"""The trust pipeline end to end: a gateway with two worker processes, two honest miners (the
real miner on the reference server), eight miners that cheat in known ways, and a verifier on
loopback signing its calls, through short epochs.

Asserted: who qualified and who was pulled, the verdicts and their reasons, the published
payload (digest, signature over the exact message, weights read only from `result_json`), and
that the weights equal what the request log and verdicts give by hand: honest miners paid,
every cheater at 0.

Timing is scaled down (`gateway.traffic_time_scale`) and probes are short (`probe_max_tokens`) so
this runs in a few minutes on two CPU cores; the probes come from a corpus of long-answer
prompts, so that the miner that decodes past the end of an answer behaves during qualification
and is caught on the short answers of paid traffic.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable

import httpx
import openai
import pytest
import trio
from bittensor.sp_core import Keypair

from engy_node import calibration, keys
from engy_node.config import load_config
from engy_node.gateway.role import run_gateway, store_path
from engy_node.gateway.store import Store
from engy_node.hub import Hub
from engy_node.miner.link import GatewayLink, Identity, LinkSettings
from engy_node.miner.serving import RequestHandler
from engy_node.models import SMOLLM2_135M
from engy_node.protocol.epoch import parse_and_verify
from engy_node.protocol.miner import Capacity
from engy_node.serve.client import ServeClient
from engy_node.serve.engine import ModelRunner
from engy_node.served_model import load_served_model
from engy_node.verifier.judge import Judge
from engy_node.verifier.role import Verifier
from engy_node.verifier.sources import HttpAuditSource
from tests.conftest import ServerProcess
from tests.engy_node.gateway.cheaters import Cheat, CheatingHandler, cheating_link

MODEL = SMOLLM2_135M.id
FAST = LinkSettings(heartbeat_s=5, backoff_base_s=0.05, backoff_cap_s=0.2, reconnect_delay_s=0.05)
EPOCH_S = 20
GRACE_S = 45
HONEST = ("honest-a", "honest-b")
CHEATS = (
    Cheat("quantised-4bit", generator="quantised"),
    Cheat("truncated", generator="truncated"),
    Cheat("prefill-greedy", generator="quantised", prover="honest", sampling=False),
    Cheat("prefill-sampled", generator="quantised", prover="honest"),
    Cheat("garbage-proofs", garbage_proofs=True),
    Cheat("usage-padding", usage_factor=3),
    Cheat("token-swap", swap_after_proving=True),
    Cheat("past-eos", past_eos=True),
)
CAUGHT_BY = {
    "quantised-4bit": {"chunks"},
    "truncated": {"chunks"},
    "prefill-greedy": {"tokens"},
    "prefill-sampled": {"tokens"},
    "garbage-proofs": {"chunks", "malformed-proof"},
    "usage-padding": {"usage-padding"},
    "token-swap": {"output-mismatch"},
    "past-eos": {"past-eos"},
}
"""The verdict reason(s) each cheat is caught by (`proof.Verdict.reason`, or the gateway's own)."""
LONG_ANSWERS = (
    "Write a detailed, multi-paragraph essay on the history of the printing press and its effect on Europe.",
    "Explain step by step, at length, how a compiler turns source code into machine code.",
    "Describe in detail the water cycle, covering evaporation, condensation, precipitation and runoff.",
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Give a thorough explanation of how vaccines train the immune system, with examples.",
    "Write a comprehensive guide to planning a two-week trip through Japan.",
)
COUNTRIES = (
    "France",
    "Italy",
    "Spain",
    "Germany",
    "Japan",
    "Egypt",
    "Canada",
    "Peru",
    "Kenya",
    "Norway",
    "Chile",
    "India",
    "Greece",
    "Poland",
    "Cuba",
    "Iran",
    "Mexico",
    "Sweden",
)
SHORT_ANSWER = "What is the capital of {}? Answer with one word."


def hotkey_of(name: str) -> str:
    return Keypair.create_from_uri(f"//{name}").ss58_address


@pytest.fixture
def one_thread():
    """Everything in this test shares two cores: the cheaters' decoding and the verifier's recompute
    here, the honest miners' model server beside. Torch's thread pools would spin against each
    other (each several times slower); one thread each keeps every party's latency honest."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def honest_server(checkpoint, tmp_path_factory):
    server = ServerProcess(
        tmp_path_factory.mktemp("honest-serve"), "--max-running-requests", "4", env={"OMP_NUM_THREADS": "1"}
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cheap_runners(checkpoint):
    def load() -> ModelRunner:
        return ModelRunner.load(checkpoint, device="cpu", dtype="bfloat16")

    return {"quantised": calibration.quantise_linear_weights(load()), "truncated": calibration.truncate_layers(load())}


async def wait_until(condition, *, timeout_s: float, what: str | Callable[[], str], every_s: float = 0.5):
    """`what` names what was awaited; a callable is asked at the timeout, so it can tell how things stood then."""
    with trio.move_on_after(timeout_s):
        while True:
            value = await condition()
            if value:
                return value
            await trio.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what() if callable(what) else what}")


@pytest.mark.minutes
async def test_honest_miners_qualify_and_are_paid_and_every_cheater_is_caught_and_scores_zero(
    nursery, tmp_path, checkpoint, honest_server, runner, cheap_runners, alice, one_thread
):
    wallets = tmp_path / "wallets"
    master = keys.create_wallet(wallets, "master", "default")
    owner = hotkey_of("Owner")
    corpus = tmp_path / "probes.jsonl"
    corpus.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n" for text in LONG_ANSWERS)
    )
    genesis = int(time.time())
    env = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    config = load_config(
        home=tmp_path,
        env=env,
        overrides={
            "gateway": {
                "port": 0,
                "miner_port": 0,
                "provider_port": 0,
                "workers": 2,
                "qualify_probes": 3,
                "traffic_time_scale": 0.1,
                "probe_max_tokens": 40,
                "probe_concurrency": 3,
                "probe_corpus": str(corpus),
                "audit_paid_pct": 100.0,
                "verifiers": alice.ss58_address,
                "epoch_genesis": genesis,
                "epoch_s": EPOCH_S,
                "epoch_grace_s": GRACE_S,
                "gate_min_samples": 1,
                "wallets_path": str(wallets),
                "master_wallet": "master/default",
                "owner_hotkey": owner,
                # The cheaters decode their whole answer before the first byte, three of them
                # taking turns on one quantised model, on a CPU shared with the other test
                # workers: a first byte can take longer than the 15 s meant for a GPU, and a 504
                # pulls a cheater for failing qualification before any verdict names its cheat.
                "first_byte_wait_s": 120.0,
            }
        },
    )
    hub = Hub()
    urls = await nursery.start(run_gateway, config, hub)
    store = Store.open(store_path(config))
    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    http = httpx.AsyncClient(timeout=120)
    identity_of: dict[str, str] = {}

    def register(name: str) -> str:
        miner_id, miner_key = store.register_miner(name, hotkey=hotkey_of(name))
        identity_of[name] = f"key:{miner_id}"
        return miner_key

    for name in HONEST:
        handler = RequestHandler(model=served, serve=lambda: ServeClient(honest_server.url, http))
        link = GatewayLink(
            gateway_url=urls.miner_url,
            identity=Identity(miner_key=register(name)),
            http=http,
            handler=handler,
            settings=FAST,
            limits=Capacity(0, 4, 6144, 2048, 600),
            hello={
                "model": MODEL,
                "model_root": served.model_root,
                "hw": {},
                "versions": {},
                "worker_name": name,
                "worker_id": uuid.uuid4().hex,
            },
        )
        await nursery.start(link.run)
    runners = {"honest": runner, **cheap_runners}
    locks = {name: trio.Lock() for name in runners}
    for cheat in CHEATS:
        handler = CheatingHandler(served, runners, locks, cheat)
        await nursery.start(
            cheating_link(
                gateway_url=urls.miner_url,
                served=served,
                identity=Identity(miner_key=register(cheat.name)),
                handler=handler,
                http=http,
                settings=FAST,
            ).run
        )
    judge = Judge({MODEL: checkpoint}, dtype="float32", threads=1)
    await nursery.start(
        Verifier(HttpAuditSource(urls.provider_url, keypair=alice, netuid=53), judge.judge, poll_s=0.2).run
    )
    name_of = {identity: name for name, identity in identity_of.items()}

    def states() -> dict[str, dict]:
        workers = hub.states().get("traffic", {}).get("workers", [])
        return {name_of[w["miner"]]: w for w in workers if w["miner"] in name_of}

    qualifying = ("past-eos", *HONEST)

    async def settled() -> bool:
        now = states()
        return all(now.get(name, {}).get("state") == "active" for name in qualifying) and all(
            now.get(c.name, {}).get("state") == "pulled" for c in CHEATS if c.name not in qualifying
        )

    # Qualification is probes served by SmolLM2 on the CPU: ~2 minutes alone here, and a loaded
    # machine has taken over 5.
    await wait_until(
        settled, timeout_s=600, what=lambda: f"honest and past-eos active, the other cheaters pulled: {states()}"
    )

    buyer, key = store.create_buyer("buyer")
    store.credit(buyer, micro_usd=1_000_000)
    # Three at a time with retries: the active miners have five slots per gateway process, one of
    # them the past-EOS miner's until it is pulled, and there is no waiting room yet (a 503 names
    # no miner and counts against none).
    client = openai.OpenAI(base_url=urls.buyer_url + "/v1", api_key=key, max_retries=4, timeout=300)
    paid_from = time.time()
    limiter = trio.CapacityLimiter(3)

    async def ask(country: str) -> None:
        async with limiter:
            await trio.to_thread.run_sync(
                lambda: client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": SHORT_ANSWER.format(country)}],
                    max_tokens=40,
                    temperature=0,
                )
            )

    async with trio.open_nursery() as burst:
        for country in COUNTRIES:
            burst.start_soon(ask, country)
    paid_until = time.time()

    async def audited_all() -> bool:
        audit = hub.states().get("audit", {})
        return audit.get("waiting") == 0 and audit.get("leased") == 0

    def unjudged() -> set[str]:
        answered = {
            entry.request_id
            for entry in store.requests_in(since=paid_from, until=time.time() + 1)
            if entry.kind == "paid" and 200 <= entry.status < 300
        }
        assert answered
        return answered - {
            record.request_id for _, record in store.verdicts_after(0, limit=100_000) if record.kind == "paid"
        }

    async def every_paid_answer_judged() -> bool:
        return not unjudged()

    # Every paid answer is audited (audit_paid_pct = 100), whichever gateway process served it: the
    # other process's jobs reach the queue over the audit link, a moment after the answer.
    await wait_until(every_paid_answer_judged, timeout_s=180, what="a verdict on every paid answer")
    await wait_until(audited_all, timeout_s=120, what="the verifier to judge every audit job")
    assert states()["past-eos"]["state"] == "pulled", "the miner decoding past EOS is pulled once paid audits catch it"
    last_paid_epoch = (int(paid_until) - genesis) // EPOCH_S
    epoch_end = genesis + (last_paid_epoch + 1) * EPOCH_S

    async def published() -> bool:
        latest = await http.get(urls.provider_url + "/api/subnet/v1/epoch/latest")
        return latest.status_code == 200 and latest.json()["epoch_index"] >= last_paid_epoch

    await wait_until(
        published, timeout_s=epoch_end + GRACE_S + 60 - time.time(), what="the epochs of the paid traffic to close"
    )

    # Who qualified and who was pulled, and why.
    final = states()
    for name in HONEST:
        assert final[name]["state"] == "active" and not any(t["to"] == "pulled" for t in final[name]["history"]), final[
            name
        ]
    for cheat in CHEATS:
        assert any(t["to"] == "pulled" for t in final[cheat.name]["history"]), final[cheat.name]
    assert any(t["to"] == "active" for t in final["past-eos"]["history"]), "past-eos qualified on long answers"
    assert not any(t["to"] == "active" for c in CHEATS if c.name != "past-eos" for t in final[c.name]["history"])

    # The verdicts.
    verdicts: dict[str, list] = {}
    for _, record in store.verdicts_after(0, limit=100_000):
        verdicts.setdefault(name_of[record.miner], []).append(record)
    for name in HONEST:
        assert verdicts[name] and all(v.verdict == "pass" for v in verdicts[name]), [
            (v.verdict, v.reason) for v in verdicts[name]
        ]
    for cheat in CHEATS:
        judged = verdicts.get(cheat.name, [])
        reasons = {v.reason for v in judged if v.verdict in ("cheat", "unproven")}
        assert reasons & CAUGHT_BY[cheat.name], (cheat.name, [(v.verdict, v.reason) for v in judged], final[cheat.name])
        assert any(v.verdict == "cheat" for v in judged) or cheat.name == "garbage-proofs"

    # Each epoch with paid traffic: the payload verifies, and its weights are the hand-computed ones.
    paid_hotkeys: dict[str, int] = {}
    for index in range((int(paid_from) - genesis) // EPOCH_S, last_paid_epoch + 1):
        raw = (await http.get(urls.provider_url + f"/api/subnet/v1/epoch/{index}")).content
        epoch = parse_and_verify(raw, master_hotkey=master, netuid=53)
        wire = json.loads(raw)
        assert keys.verify_signature(
            master, keys.epoch_message(53, index, keys.epoch_digest(wire["result_json"].encode())), wire["signature"]
        )
        start, end = genesis + index * EPOCH_S, genesis + (index + 1) * EPOCH_S
        expected = expected_weights(
            store.requests_in(since=start, until=end),
            store.verdict_counts(since=start, until=end),
            hotkey_of_identity={identity: hotkey_of(name) for name, identity in identity_of.items()},
            owner=owner,
        )
        assert dict(epoch.weights) == expected, (index, epoch.weights, expected)
        for hotkey, weight in epoch.weights:
            paid_hotkeys[hotkey] = paid_hotkeys.get(hotkey, 0) + weight
    for name in HONEST:
        assert paid_hotkeys.get(hotkey_of(name), 0) > 0, f"{name} was paid"
    for cheat in CHEATS:
        assert hotkey_of(cheat.name) not in paid_hotkeys, f"{cheat.name} scored"
    # The honest miners' links serve through `http` until they stop, and the gateway keeps probing
    # active miners: stop them before closing it (a probe that came after the close failed this
    # test once its assertions had all passed).
    nursery.cancel_scope.cancel()
    await http.aclose()
    store.close()


def expected_weights(entries, verdict_counts, *, hotkey_of_identity, owner) -> dict[str, int]:
    """Epoch settlement (docs/trust.md) by hand for small samples (every gate minimum 1): a hotkey scores its counted
    tokens × score_rate // 1000 unless any paid attempt failed, a latency went over the model's
    ceiling, or any verdict on it was `cheat`."""
    tokens: dict[str, int] = {}
    failed: set[str] = set()
    for entry in entries:
        if entry.kind != "paid" or entry.miner is None:
            continue
        hotkey = hotkey_of_identity[entry.miner]
        if entry.status == 499:
            continue
        if not 200 <= entry.status < 300:
            failed.add(hotkey)
            continue
        if entry.cost_micro > 0:
            tokens[hotkey] = tokens.get(hotkey, 0) + entry.prompt_tokens + entry.completion_tokens
            if (entry.ttft_ms or 0) > SMOLLM2_135M.qual_ttft_p99_ms or (
                entry.tpot_ms or 0
            ) > SMOLLM2_135M.qual_tpot_p99_ms:
                failed.add(hotkey)
    cheated = {hotkey_of_identity[identity] for identity, (_, cheat, _) in verdict_counts.items() if cheat}
    scores = {
        hotkey: count * SMOLLM2_135M.score_rate // 1000
        for hotkey, count in tokens.items()
        if hotkey not in failed and hotkey not in cheated
    }
    scores = {hotkey: score for hotkey, score in scores.items() if score > 0}
    total = sum(scores.values())
    if not total:
        return {owner: 65535}
    weights = {hotkey: score * 65535 // total for hotkey, score in scores.items()}
    top = max(scores, key=lambda hotkey: (scores[hotkey], -sorted(scores).index(hotkey)))
    weights[top] += 65535 - sum(weights.values())
    return {hotkey: weight for hotkey, weight in weights.items() if weight}
