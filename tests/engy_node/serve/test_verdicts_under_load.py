"""Our own reference server's answers to concurrent requests, judged as the verifier judges them.

Issue 29 saw our honest reference miner judged `cheat (tokens)` once in 262 verdicts under 50-way
load. The reference server steps each request on its own (no batched forward pass), so
concurrency alone changes no arithmetic (`test_engine`'s bit-for-bit check): that verdict was
the count rule, since replaced by the miss rule, judging an honest answer's near-ties
(`CONVERSATIONS`). What load has changed since is the prefix cache: whether a prompt finds
itself, or an earlier turn and its answer, already computed depends on what finished before it,
and a prompt continued from cached KV (computed by another prefill, or by decode steps) rounds
near-ties differently from the verifier's cold prefill. Those answers are honest and must be
judged so ("Verdicts on honest miners under load" in docs/verification.md has the measurements).
"""

from __future__ import annotations

import time
import uuid

import httpx
import numpy as np
import torch
import trio

from engy_node import proof
from engy_node.calibration import chat_ids
from engy_node.drift import FOLLOW_UP, drift_conversations
from engy_node.models import SMOLLM2_135M, model_root
from engy_node.protocol.audit import AuditJob
from engy_node.protocol.miner import Sampling
from engy_node.serve.client import GenerateResult, ServeClient
from engy_node.verifier.judge import Judge

NEW_TOKENS = 24
CONVERSATIONS = (0, 2)
"""Drift conversations with near-ties in their first 24 tokens (measured on this project's
machines, fp32 recompute): the first, served again from the prefix cache, flips one at token 13
and goes on to three; the second has three even cold. Three misses in 24 tokens were a cheat
under the count rule the miss rule replaced (more than max(2, 10 %)), which is how an honest
answer was judged `cheat (tokens)` under load."""
GREEDY = {"temperature": 0}


async def serve_all(serve: ServeClient, prompts: list[list[int]]) -> list[GenerateResult]:
    """Every prompt at once, as concurrent buyers send them."""
    results: list[GenerateResult | None] = [None] * len(prompts)

    async def one(index: int) -> None:
        results[index] = await serve.generate(prompts[index], GREEDY, max_new_tokens=NEW_TOKENS)

    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            for index in range(len(prompts)):
                nursery.start_soon(one, index)
    return [result for result in results if result is not None]


def job_of(checkpoint, prompt_ids: list[int], result: GenerateResult) -> AuditJob:
    """The audit job the gateway files for this answer, with the commitment our miner builds."""
    commitment = proof.build_commitment(
        model_root=model_root(checkpoint),
        prompt_ids=prompt_ids,
        output_ids=result.output_ids,
        rows=torch.from_numpy(np.asarray(result.hidden_rows, dtype=np.float32)),
        params=SMOLLM2_135M.proof,
    )
    return AuditJob(
        request_id=uuid.uuid4().hex,
        model=SMOLLM2_135M.id,
        miner="key:reference",
        kind="paid",
        prompt_ids=tuple(prompt_ids),
        commitment=commitment.to_wire(),
        greedy=True,
        sampling=Sampling(),
        seeded=False,
        delivery=proof.Delivery(tuple(result.output_ids), ended_at_stop=False, max_tokens=NEW_TOKENS),
        created_at=time.time(),
    )


async def test_concurrent_answers_from_the_prefix_cache_are_judged_honest(reference_server, checkpoint, runner):
    conversations = [drift_conversations(max(CONVERSATIONS) + 1)[index] for index in CONVERSATIONS]
    prompts = [chat_ids(runner, conversation) for conversation in conversations]
    async with httpx.AsyncClient(timeout=120) as http:
        serve = ServeClient(reference_server.url, http)
        first = await serve_all(serve, prompts)
        # The same prompts again, and each conversation's next turn over its own answer: the
        # prompt, or the prompt and the answer's decode steps, come from the prefix cache.
        follow_ups = [
            chat_ids(
                runner,
                [*conversation, {"role": "assistant", "content": answer.text}, {"role": "user", "content": FOLLOW_UP}],
            )
            for conversation, answer in zip(conversations, first)
        ]
        second = await serve_all(serve, prompts + follow_ups)
    assert all(answer.cached_tokens > 0 for answer in second), [answer.cached_tokens for answer in second]

    judge = Judge({SMOLLM2_135M.id: checkpoint}, dtype="float32")
    answered = list(zip(prompts + prompts + follow_ups, first + second))
    verdicts = [judge.judge(job_of(checkpoint, ids, answer)) for ids, answer in answered]
    assert [verdict.kind for verdict in verdicts] == ["pass"] * len(answered), [
        (verdict.code, answer.cached_tokens) for verdict, (_, answer) in zip(verdicts, answered)
    ]
