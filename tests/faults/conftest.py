"""The fault suite's shared pieces: synthetic miners in this process whose answers can be held at
a chosen point, SDK buyers that record what reached them and how their call ended, one gateway
process for the faults that leave it standing, and the figures each run measured (faults
injected, requests around them, time to serve again), printed at the end of the run for
docs/reliability.md."""

from __future__ import annotations

import dataclasses
import time
import uuid

import httpx
import openai
import pytest
import trio

from engy_node.gateway.store import Store
from engy_node.miner.link import GatewayLink, Identity, LinkSettings
from engy_node.models import SMOLLM2_135M
from engy_node.served_model import ServedModel, load_served_model
from engy_node.testing.faults import Gate, GatedHandler, ProcessAccount
from engy_node.testing.synthetic_miner import Script, SyntheticHandler, synthetic_link
from tests.faults.nodes import GatewayProcess
from tests.waiting import Changes

MODEL = SMOLLM2_135M.id
FAST = LinkSettings(heartbeat_s=5, backoff_base_s=0.05, backoff_cap_s=0.2, reconnect_delay_s=0.05)
"""A miner link that re-dials a restarted gateway within a fifth of a second."""
CALL_TIMEOUT_S = 60.0
"""Longest any buyer call may take in the suite: a call still open past it is a hang, a failure."""

_FIGURES: list[str] = []


class Figures:
    """What a fault test measured, for the run's summary (and docs/reliability.md)."""

    def record(self, name: str, value: float | int | str, unit: str = "") -> None:
        _FIGURES.append(f"{name}: {value:.2f}{unit}" if isinstance(value, float) else f"{name}: {value}{unit}")


@pytest.fixture
def figures() -> Figures:
    return Figures()


def pytest_terminal_summary(terminalreporter) -> None:
    if _FIGURES:
        terminalreporter.section("fault suite figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def served(checkpoint) -> ServedModel:
    return load_served_model(SMOLLM2_135M, checkpoint)


def new_buyer(store_path, *, dollars: float = 1.0) -> tuple[int, str]:
    with Store.open(store_path) as store:
        account_id, key = store.create_buyer(f"buyer-{uuid.uuid4().hex[:8]}")
        store.credit(account_id, micro_usd=int(dollars * 1_000_000))
    return account_id, key


def register_miner(store_path, name: str, *, hotkey: str | None = None) -> str:
    with Store.open(store_path) as store:
        _, key = store.register_miner(f"{name}-{uuid.uuid4().hex[:6]}", hotkey=hotkey)
    return key


@dataclasses.dataclass
class SyntheticMiner:
    """A synthetic miner on the real link in this process: its handler (the gates, what it served)
    and its link (its legs)."""

    handler: GatedHandler
    link: GatewayLink
    legs: Changes

    async def wait_legs(self, count: int, *, timeout_s: float = 30.0) -> None:
        """Until `count` legs are admitted (one per gateway worker)."""
        await self.legs.wait_for(
            lambda: sum(self.link.legs_up.values()) >= count, timeout_s=timeout_s, what=f"{count} leg(s) admitted"
        )


async def start_synthetic_miner(
    nursery: trio.Nursery,
    *,
    store_path,
    miner_url: str,
    served: ServedModel,
    http: httpx.AsyncClient,
    script,
    gate_for=lambda frame: None,
    name: str = "synthetic",
    hotkey: str | None = None,
) -> SyntheticMiner:
    """A synthetic miner on the real link, its answers passed through the gates `gate_for` gives."""
    key = register_miner(store_path, name, hotkey=hotkey)
    handler = GatedHandler(SyntheticHandler(served, script), gate_for)
    link = synthetic_link(
        gateway_url=miner_url,
        model=served,
        identity=Identity(miner_key=key),
        handler=handler,
        http=http,
        settings=FAST,
        worker_name=name,
    )
    legs = Changes()
    link.on_state = legs.notify
    await nursery.start(link.run)
    return SyntheticMiner(handler, link, legs)


def words(count: int) -> str:
    """Plain words, nothing an output parser holds back (no `<`) and no stop string."""
    return " ".join(f"word{index}" for index in range(count)) + "."


def plain_script(text: str, *, chunk_chars: int = 6) -> Script:
    """One chunk frame per `chunk_chars` characters, never coalesced, so a gate's chunk count is exact."""
    return Script(text=text, chunk_chars=chunk_chars, coalesce_s=0.0)


@dataclasses.dataclass
class BuyerCall:
    """One streamed or plain chat completion through the OpenAI SDK, run as a task: what reached
    the buyer, when, and how it ended. `error` is the exception the SDK raised (None: it completed)."""

    api: str
    key: str
    content: str
    stream: bool = True
    max_tokens: int = 64
    text: str = ""
    usage: openai.types.CompletionUsage | None = None
    error: BaseException | None = None
    first_text: trio.Event = dataclasses.field(default_factory=trio.Event)
    text_changed: trio.Event = dataclasses.field(default_factory=trio.Event)
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    ended_at: float | None = None

    async def run(self) -> None:
        try:
            with trio.fail_after(CALL_TIMEOUT_S):
                async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
                    client = openai.AsyncOpenAI(base_url=self.api, api_key=self.key, max_retries=0, http_client=http)
                    messages = [{"role": "user", "content": self.content}]
                    if self.stream:
                        stream = await client.chat.completions.create(
                            model=MODEL,
                            messages=messages,
                            max_tokens=self.max_tokens,
                            stream=True,
                            stream_options={"include_usage": True},
                        )
                        async for chunk in stream:
                            if chunk.usage is not None:
                                self.usage = chunk.usage
                            if chunk.choices and chunk.choices[0].delta.content:
                                self._add(chunk.choices[0].delta.content)
                    else:
                        completion = await client.chat.completions.create(
                            model=MODEL, messages=messages, max_tokens=self.max_tokens
                        )
                        self.usage = completion.usage
                        self._add(completion.choices[0].message.content or "")
        except (openai.APIError, httpx.HTTPError, trio.TooSlowError) as error:
            self.error = error
        finally:
            self.ended_at = time.monotonic()
            self.done.set()

    @property
    def told_of_a_failure(self) -> bool:
        """The call ended with an error the buyer was given (a dropped connection, an error
        status or event), not by running out of `CALL_TIMEOUT_S`, which is a hang."""
        return self.error is not None and not isinstance(self.error, trio.TooSlowError)

    def _add(self, text: str) -> None:
        self.text += text
        self.first_text.set()
        self.text_changed.set()
        self.text_changed = trio.Event()

    async def wait_for_text(self, expected: str, *, timeout_s: float = 30.0) -> None:
        """Until the buyer has received exactly `expected` so far."""
        with trio.fail_after(timeout_s):
            while self.text != expected:
                assert expected.startswith(self.text), f"the buyer received {self.text!r}, not a prefix of {expected!r}"
                if self.done.is_set():
                    raise AssertionError(
                        f"the call ended ({self.error!r}) having received {self.text!r}, not {expected!r}"
                    )
                await self.text_changed.wait()

    async def ended(self, *, timeout_s: float = CALL_TIMEOUT_S) -> None:
        with trio.fail_after(timeout_s):
            await self.done.wait()


def gate_by_content(gates: dict[str, Gate]):
    """A `gate_for` that holds each request whose user message is one of `gates`' keys."""

    def gate_for(frame) -> Gate | None:
        return gates.get(frame.request.messages[-1].content)

    return gate_for


@pytest.fixture(scope="session")
def shared_gateway(tmp_path_factory):
    """One gateway process for the faults that leave it standing (stalling miners, miners and
    model servers killed): started once, stopped at the end with every process of its home gone."""
    home = tmp_path_factory.mktemp("shared-gateway")
    account = ProcessAccount(home)
    gateway = GatewayProcess(home, account)
    gateway.start()
    yield gateway
    assert gateway.stop() == 0, gateway.text()
    account.note_marked()
    assert account.alive() == [], "every process of the gateway's home has exited"
    assert account.listening() == [], "no port the gateway used still listens"
