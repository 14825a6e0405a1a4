"""The public one-file SN53 miner (release 0.4.4) as our gateway meets it: its frames, its habits.

Written by hand from its frame shapes (docs/protocol.md, issue 8), not from its code, so a test can hold
our gateway to living with it:

* hello: `capacity.max_request_s` as a float (`1800.0`, it applies `float()` to the setting),
  `hw.gpus` / `hw.parallelism` as strings, `versions: {}`, `instance_id` beside `worker_name`,
  no `features`;
* a heartbeat every interval carrying the same capacity again, with `inflight: 0` always;
* always greedy: it ignores `sampling` (temperature, seed, stop strings) and `tools`, and renders
  the prompt from each message's role and content only;
* `finish_reason: "stop"` always, even when the answer hit `max_tokens`;
* streamed text as `chunk` deltas, then a `response` with a real TOPLOC commitment.

Generation runs on the reference server (greedy `/generate` with hidden states), so its answers
and commitments are real.
"""

from __future__ import annotations

import json
import uuid

import numpy as np
import torch
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from engy_node import proof
from engy_node.serve.client import ServeClient
from engy_node.served_model import ServedModel

CAPACITY = {
    "max_inflight": 4,
    "max_inflight_total": 4,
    "max_input_tokens": 229376,
    "max_output_tokens": 32768,
    "max_request_s": 1800.0,
}
HW = {
    "parallelism": "tp",
    "host": "rig-1",
    "cpus": 32,
    "ram_gb": 125.7,
    "gpu": "NVIDIA GeForce RTX 4090",
    "gpu_count": 4,
    "gpu_mem_gb": 24.0,
    "torch": "2.9.1+cu128",
    "cuda": "12.8",
    "gpus": "4x NVIDIA GeForce RTX 4090",
}


class PublicMiner:
    def __init__(
        self,
        *,
        url: str,
        miner_key: str,
        model: ServedModel,
        serve: ServeClient,
        heartbeat_s: float,
        proved_prompt=lambda prompt_ids: prompt_ids,
        shown=lambda text: text,
        held_back_chars: int = 0,
    ) -> None:
        self.url = url
        self.proved_prompt = proved_prompt
        """The prompt ids its commitment names: the prompt it was sent, unless a test makes it cheat."""
        self.shown = shown
        """What it makes of the server's cumulative text before slicing deltas out of it by
        length, and of its final text: unchanged, unless a test gives it a formatting bug."""
        self.held_back_chars = held_back_chars
        """A tail of the text it never streams and strips from its final text (a newer public
        miner's habit)."""
        self.miner_key = miner_key
        self.model = model
        self.serve = serve
        self.heartbeat_s = heartbeat_s
        self.worker_name = "ins-" + uuid.uuid4().hex[:12]
        self.heartbeats_sent = 0
        self.heartbeat_sent = trio.Event()
        self.served: list[dict] = []
        self.close_reason: str | None = None
        self.closed = trio.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """One leg: hello, admit, then serve until the gateway closes the connection."""
        async with open_websocket_url(self.url) as ws:
            await ws.send_message(
                json.dumps(
                    {
                        "type": "hello",
                        "miner_key": self.miner_key,
                        "model": self.model.spec.id,
                        "model_root": self.model.model_root,
                        "hw": HW,
                        "versions": {},
                        "capacity": CAPACITY,
                        "worker_name": self.worker_name,
                        "instance_id": self.worker_name,
                        "worker_id": uuid.uuid4().hex,
                    }
                )
            )
            first = json.loads(await ws.get_message())
            if first.get("type") != "admit":
                raise AssertionError(f"the gateway did not admit the public miner: {first}")
            task_status.started()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._heartbeats, ws)
                    await self._receive(ws, nursery)
            except* ConnectionClosed as closed:
                # Either task may be the first to meet the closed socket (a heartbeat sent after
                # the gateway went away): the leg ends the same way.
                reason = closed.exceptions[0].reason
                self.close_reason = reason.reason if reason else None
            finally:
                self.closed.set()

    async def _heartbeats(self, ws) -> None:
        while True:
            await trio.sleep(self.heartbeat_s)
            await ws.send_message(
                json.dumps({"type": "heartbeat", "inflight": 0, "idle_seconds": 0.0, "capacity": CAPACITY})
            )
            self.heartbeats_sent += 1
            self.heartbeat_sent.set()
            self.heartbeat_sent = trio.Event()

    async def _receive(self, ws, nursery: trio.Nursery) -> None:
        active: dict[str, trio.CancelScope] = {}
        while True:
            frame = json.loads(await ws.get_message())
            if frame["type"] == "serve":
                scope = trio.CancelScope()
                active[frame["corr_id"]] = scope
                nursery.start_soon(self._serve, ws, frame, scope)
            elif frame["type"] == "cancel" and frame["corr_id"] in active:
                active.pop(frame["corr_id"]).cancel()
            elif frame["type"] == "ping":
                await ws.send_message(
                    json.dumps({"type": "heartbeat", "inflight": 0, "idle_seconds": 0.0, "capacity": CAPACITY})
                )
            elif frame["type"] == "reconnect":
                nursery.cancel_scope.cancel()
                return

    def take(self, request: dict) -> list[int]:
        """Record a routed request and render its prompt from each message's role and content only."""
        self.served.append(request)
        messages = [{"role": m["role"], "content": m["content"]} for m in request["messages"]]
        rendered = self.model.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(rendered if isinstance(rendered, list) else rendered["input_ids"])

    async def _serve(self, ws, frame: dict, scope: trio.CancelScope) -> None:
        with scope:
            request = frame["request"]
            prompt_ids = self.take(request)
            corr_id = frame["corr_id"]
            sent = ""

            async def relay(ids: list[int], server_text: str) -> None:
                nonlocal sent
                shown = self.shown(server_text)
                shown = shown[: max(0, len(shown) - self.held_back_chars)]
                if frame.get("stream") and len(shown) > len(sent):
                    await ws.send_message(
                        json.dumps({"type": "chunk", "corr_id": corr_id, "delta": {"content": shown[len(sent) :]}})
                    )
                    sent = shown

            result = await self.serve.generate_once(
                prompt_ids,
                {"temperature": 0.0, "max_new_tokens": request.get("max_tokens") or 512},
                rid="engy-" + uuid.uuid4().hex,
                stream=bool(frame.get("stream")),
                on_progress=relay,
            )
            meta = result["meta_info"]
            output_ids = [int(entry[1]) for entry in meta["output_token_logprobs"]]
            rows = [item[-1] if isinstance(item[0], list) else item for item in meta["hidden_states"] if len(item)]
            commitment = proof.build_commitment(
                model_root=self.model.model_root,
                prompt_ids=self.proved_prompt(prompt_ids),
                output_ids=output_ids,
                rows=torch.from_numpy(np.asarray(rows, dtype=np.float32)).to(torch.bfloat16),
                params=self.model.spec.proof,
            )
            text = self.shown(self.model.tokenizer.decode(output_ids, skip_special_tokens=True))
            text = text[: max(0, len(text) - self.held_back_chars)]
            await ws.send_message(
                json.dumps(
                    {
                        "type": "response",
                        "corr_id": corr_id,
                        "request_id": request.get("engy_request_id") or uuid.uuid4().hex,
                        "commitment": commitment.to_wire(),
                        "output": {
                            "choices": [
                                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
                            ],
                            "usage": {
                                "prompt_tokens": len(prompt_ids),
                                "completion_tokens": len(output_ids),
                                "total_tokens": len(prompt_ids) + len(output_ids),
                            },
                        },
                    }
                )
            )


class TeeLikeMiner(PublicMiner):
    """A miner like the newest public `tee_miner.py` on the wire, with the newest one-file miner's
    streaming habits: the public frames above, but `commitment: {}` (it relies on attestation),
    streamed text with a tail held back and stripped from the final text, stop strings and
    sampling ignored. It generates greedily on a model of its own (`runner`: the canonical
    weights in bf16, or a cheaper copy), one request at a time, so a test can run an honest one
    and a 4-bit one side by side without a model server each."""

    def __init__(self, *, runner, lock: trio.Lock, **kwargs) -> None:
        super().__init__(serve=None, **kwargs)
        self.runner = runner
        self.lock = lock

    async def _serve(self, ws, frame: dict, scope: trio.CancelScope) -> None:
        from engy_node.calibration import greedy_generation

        with scope:
            request = frame["request"]
            prompt_ids = self.take(request)
            async with self.lock:
                generation = await trio.to_thread.run_sync(
                    greedy_generation, self.runner, prompt_ids, request.get("max_tokens") or 512
                )
            output_ids = list(generation.output_ids)
            text = self.model.tokenizer.decode(output_ids, skip_special_tokens=True)
            shown = text[: max(0, len(text) - self.held_back_chars)]
            corr_id = frame["corr_id"]
            if frame.get("stream"):
                for start in range(0, len(shown), 8):
                    await ws.send_message(
                        json.dumps(
                            {"type": "chunk", "corr_id": corr_id, "delta": {"content": shown[start : start + 8]}}
                        )
                    )
            await ws.send_message(
                json.dumps(
                    {
                        "type": "response",
                        "corr_id": corr_id,
                        "request_id": request.get("engy_request_id") or uuid.uuid4().hex,
                        "commitment": {},
                        "output": {
                            "choices": [
                                {
                                    "index": 0,
                                    "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": shown},
                                }
                            ],
                            "usage": {
                                "prompt_tokens": len(prompt_ids),
                                "completion_tokens": len(output_ids),
                                "total_tokens": len(prompt_ids) + len(output_ids),
                            },
                        },
                    }
                )
            )
