"""`engy-node up --traffic`: a buyer that keeps a local network busy, so dashboards move, probes
mix with paid requests, verdicts accrue and epochs have tokens to settle.

It is an ordinary client of the buyer API: the local buyer key, over HTTP, through both dialects
(OpenAI chat completions and Anthropic messages), streamed and not, with conversations drawn
from the probe corpus (buyer-like by construction). Requests go one at a time per slot with a
pause between them, so on a CPU-only laptop it leaves the model server room for a person's own
requests. Failures are counted and logged once per distinct reason and minute, never retried
in a tight loop. `pause()`/`resume()` let an operator (the TUI, the control API) stop it.

`plan_request` is the pure part: which dialect, streaming or not, and the exact body.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Sequence
from typing import Any, Literal

import httpx
import trio

from engy_node.hub import Hub
from engy_node.probe_corpus import ProbePrompt, load_probe_corpus

log = logging.getLogger("engy.local.traffic")

Dialect = Literal["openai", "anthropic"]
REQUEST_TIMEOUT_S = 180.0
FAILURE_LOG_EVERY_S = 60.0
MAX_PROMPT_CHARS = 1_500
"""Longer corpus entries are skipped: on a CPU miner a long prefill holds the one model server
for seconds, and the point here is steady traffic, not load."""


@dataclasses.dataclass(frozen=True, slots=True)
class RequestPlan:
    dialect: Dialect
    stream: bool
    path: str
    """Relative to the buyer API's `/v1` base."""
    body: dict[str, Any]


def plan_request(rng: random.Random, prompts: Sequence[ProbePrompt], model: str, *, max_tokens: int) -> RequestPlan:
    """One buyer request: a corpus conversation in a random dialect, streamed half the time."""
    prompt = rng.choice(prompts)
    dialect: Dialect = rng.choice(("openai", "anthropic"))
    stream = rng.random() < 0.5
    messages = [dict(message) for message in prompt.messages]
    if dialect == "openai":
        body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": stream}
        if rng.random() < 0.5:
            body["temperature"] = round(rng.uniform(0.2, 1.0), 2)
        return RequestPlan("openai", stream, "/chat/completions", body)
    system = [message["content"] for message in messages if message["role"] == "system"]
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [message for message in messages if message["role"] != "system"],
    }
    if system:
        body["system"] = system[0]
    return RequestPlan("anthropic", stream, "/messages", body)


@dataclasses.dataclass(slots=True)
class TrafficStats:
    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    output_chars: int = 0
    last_error: str | None = None


class TrafficGenerator:
    def __init__(
        self,
        *,
        buyer_api: str,
        buyer_key: str,
        models: Sequence[str],
        hub: Hub,
        concurrency: int = 1,
        gap_s: float = 2.0,
        max_tokens: int = 48,
        seed: int | None = None,
    ) -> None:
        self.buyer_api = buyer_api.rstrip("/")
        self.buyer_key = buyer_key
        self.models = tuple(models)
        self.hub = hub
        self.concurrency = concurrency
        self.gap_s = gap_s
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.stats = TrafficStats()
        self._running = trio.Event()
        self._running.set()
        self._last_logged: dict[str, float] = {}
        prompts = [prompt for prompt in load_probe_corpus() if prompt.chars <= MAX_PROMPT_CHARS]
        self.prompts = tuple(prompts)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def pause(self) -> None:
        if not self.paused:
            self._running = trio.Event()
            log.info("demo traffic paused")
            self._publish()

    def resume(self) -> None:
        if self.paused:
            self._running.set()
            log.info("demo traffic resumed")
            self._publish()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        log.info(
            "demo traffic: %d slot(s), a request every ~%.0f s per slot, up to %d output tokens, to %s",
            self.concurrency,
            self.gap_s,
            self.max_tokens,
            self.buyer_api,
        )
        self._publish()
        # trust_env=False: the buyer API is the node's own, on loopback; a proxy from the environment
        # must neither see the buyer key nor stand between them.
        async with (
            httpx.AsyncClient(
                headers={"User-Agent": "engy-node demo traffic"},
                trust_env=False,
                timeout=httpx.Timeout(REQUEST_TIMEOUT_S),
            ) as http,
            trio.open_nursery() as nursery,
        ):
            for _ in range(self.concurrency):
                nursery.start_soon(self._slot, http)
            task_status.started()

    async def _slot(self, http: httpx.AsyncClient) -> None:
        while True:
            await self._running.wait()
            if self.paused:
                # `wait` yields even when the event is set: a pause that came meanwhile holds this slot too.
                continue
            plan = plan_request(self.rng, self.prompts, self.rng.choice(self.models), max_tokens=self.max_tokens)
            await self._send(http, plan)
            self._publish()
            # Jittered, so several slots do not fall into step.
            await trio.sleep(self.gap_s * self.rng.uniform(0.5, 1.5))

    async def _send(self, http: httpx.AsyncClient, plan: RequestPlan) -> None:
        headers = (
            {"Authorization": f"Bearer {self.buyer_key}"}
            if plan.dialect == "openai"
            else {"x-api-key": self.buyer_key, "anthropic-version": "2023-06-01"}
        )
        self.stats.sent += 1
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                async with http.stream(
                    "POST", f"{self.buyer_api}{plan.path}", json=plan.body, headers=headers
                ) as response:
                    if response.status_code != 200:
                        raise RequestFailed(f"HTTP {response.status_code}: {_error_message(await response.aread())}")
                    text = await _read_answer(response, plan)
        except (httpx.HTTPError, RequestFailed, trio.TooSlowError) as err:
            self.stats.failed += 1
            reason = str(err) or type(err).__name__
            self.stats.last_error = reason
            self._log_failure(reason)
            return
        self.stats.succeeded += 1
        self.stats.output_chars += len(text)

    def _log_failure(self, reason: str) -> None:
        key = reason[:80]
        now = time.monotonic()
        if now - self._last_logged.get(key, -FAILURE_LOG_EVERY_S) >= FAILURE_LOG_EVERY_S:
            self._last_logged[key] = now
            log.warning("demo request failed (%s); %d of %d failed so far", reason, self.stats.failed, self.stats.sent)

    def _publish(self) -> None:
        self.hub.set_state(
            "traffic_generator",
            paused=self.paused,
            sent=self.stats.sent,
            succeeded=self.stats.succeeded,
            failed=self.stats.failed,
            output_chars=self.stats.output_chars,
            last_error=self.stats.last_error,
        )


class RequestFailed(Exception):
    pass


async def _read_answer(response: httpx.Response, plan: RequestPlan) -> str:
    """The answer's text; a stream must end properly (an error event or a cut stream fails), and
    an answer that is not JSON, or not the dialect's shape, fails rather than ending the generator."""
    try:
        return await _parse_answer(response, plan)
    except ValueError as err:
        raise RequestFailed(f"the answer is not JSON ({err})") from None
    except (LookupError, TypeError, AttributeError) as err:
        raise RequestFailed(f"the answer is not in the {plan.dialect} shape ({type(err).__name__}: {err})") from None


async def _parse_answer(response: httpx.Response, plan: RequestPlan) -> str:
    if not plan.stream:
        document = json.loads(await response.aread())
        if plan.dialect == "openai":
            return document["choices"][0]["message"].get("content") or ""
        return "".join(block.get("text", "") for block in document.get("content", []))
    pieces: list[str] = []
    finished = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            finished = True
            continue
        event = json.loads(data)
        if "error" in event:
            raise RequestFailed(f"error event: {_error_message(json.dumps(event).encode())}")
        if plan.dialect == "openai":
            for choice in event.get("choices", []):
                pieces.append((choice.get("delta") or {}).get("content") or "")
        elif event.get("type") == "content_block_delta":
            pieces.append(event.get("delta", {}).get("text", ""))
        elif event.get("type") == "message_stop":
            finished = True
    if not finished:
        raise RequestFailed("the stream ended without its terminator")
    return "".join(pieces)


def _error_message(body: bytes) -> str:
    try:
        document = json.loads(body)
        return str(document["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")
