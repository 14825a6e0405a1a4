"""Miners that cheat, for the trust pipeline's end-to-end test: each speaks the real protocol over
the real link (`GatewayLink`) and serves SmolLM2 answers it computes in this process, cheating in
one known way.

They are adversaries, not stand-ins for our miner: the honest miners in the test are the real
miner role on the reference server. The cheap models are calibration's (`calibration.py`):
4-bit weights and a model with layers dropped, both claiming the canonical checkpoint.
"""

from __future__ import annotations

import base64
import dataclasses
import random
import uuid

import trio

from engy_node import proof
from engy_node.miner.link import GatewayLink, Identity, LinkSettings
from engy_node.miner.serving import Send
from engy_node.protocol.miner import FEATURE_SAMPLING, FEATURE_SEEDED, SEEDED_TOP_K, Capacity, Chunk, Response, Serve
from engy_node.serve.engine import Generation, ModelRunner, run_to_completion
from engy_node.serve.sampling import parse_sampling_params
from engy_node.served_model import ServedModel


@dataclasses.dataclass(frozen=True)
class Cheat:
    name: str
    generator: str = "honest"
    """Which runner decodes the answer: honest, quantised or truncated."""
    prover: str = "generator"
    """Whose hidden states the proof commits to: the generator's own, or an honest prefill of
    the generated tokens (the prefill attack)."""
    garbage_proofs: bool = False
    usage_factor: int = 1
    """Claimed completion tokens, as a multiple of those served."""
    swap_after_proving: bool = False
    """Relay the proved answer with one token changed."""
    past_eos: bool = False
    """Keep decoding after the model ends its answer, up to max_tokens."""
    sampling: bool = True
    """Announce that it honours sampling (and samples from the gateway's seed)."""


class CheatingHandler:
    def __init__(
        self, served: ServedModel, runners: dict[str, ModelRunner], locks: dict[str, trio.Lock], cheat: Cheat
    ) -> None:
        self.served = served
        self.runners = runners
        self.locks = locks
        self.cheat = cheat
        self.served_frames: list[Serve] = []

    async def handle(self, frame: Serve, send: Send) -> None:
        self.served_frames.append(frame)
        prompt_ids = self.served.render_prompt(frame.request)
        async with self.locks[self.cheat.generator]:
            generation = await trio.to_thread.run_sync(self._generate, prompt_ids, frame)
        output_ids = list(generation.output_ids)
        if self.cheat.prover == "honest":
            async with self.locks["honest"]:
                hidden, _ = await trio.to_thread.run_sync(self.runners["honest"].prefill, prompt_ids + output_ids[:-1])
            rows = hidden[len(prompt_ids) - 1 :]
        else:
            rows = generation.proof_rows()
        commitment = proof.build_commitment(
            model_root=self.served.model_root,
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            rows=rows,
            params=self.served.spec.proof,
        ).to_wire()
        if self.cheat.garbage_proofs:
            rng = random.Random(frame.corr_id)
            commitment["toploc"]["proofs"] = [
                base64.b64encode(rng.randbytes(len(base64.b64decode(p)))).decode()
                for p in commitment["toploc"]["proofs"]
            ]
        relayed = list(output_ids)
        if self.cheat.swap_after_proving and relayed:
            middle = len(relayed) // 2
            relayed[middle] = (relayed[middle] + 1) % self.runners["honest"].vocab_size
        text = self.served.decode(relayed)
        if frame.stream and text:
            await send(Chunk(corr_id=frame.corr_id, content=text))
        ended = bool(output_ids) and output_ids[-1] in self.served.end_token_ids
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(output_ids) * self.cheat.usage_factor,
            "total_tokens": len(prompt_ids) + len(output_ids) * self.cheat.usage_factor,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        output = {
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop" if ended else "length",
                    "message": {"role": "assistant", "content": text},
                }
            ],
            "usage": usage,
        }
        await send(
            Response(
                corr_id=frame.corr_id, request_id=frame.request.engy_request_id, commitment=commitment, output=output
            )
        )

    def _generate(self, prompt_ids: list[int], frame: Serve) -> Generation:
        sampling = frame.request.sampling
        max_new = frame.request.max_tokens or 32
        params = {"max_new_tokens": max_new, "ignore_eos": self.cheat.past_eos}
        if sampling.greedy or not self.cheat.sampling:
            params["temperature"] = 0
        else:
            params.update(
                temperature=sampling.temperature,
                top_p=sampling.top_p if sampling.top_p is not None else 1.0,
                top_k=SEEDED_TOP_K,
                min_p=0.0,
                sampling_seed=sampling.seed,
            )
        generation = Generation(
            rid=frame.corr_id,
            input_ids=list(prompt_ids),
            params=parse_sampling_params(params),
            return_hidden_states=True,
        )
        return run_to_completion(self.runners[self.cheat.generator], generation)


def cheating_link(
    *, gateway_url: str, served: ServedModel, identity: Identity, handler: CheatingHandler, http, settings: LinkSettings
) -> GatewayLink:
    spec = served.spec
    features = frozenset({FEATURE_SAMPLING, FEATURE_SEEDED}) if handler.cheat.sampling else frozenset()
    return GatewayLink(
        gateway_url=gateway_url,
        identity=identity,
        http=http,
        handler=handler,
        settings=settings,
        rng=random.Random(0),
        features=features,
        limits=Capacity(
            max_inflight=0,
            max_inflight_total=2,
            max_input_tokens=spec.max_input_tokens,
            max_output_tokens=spec.max_output_tokens,
            max_request_s=spec.max_request_s,
        ),
        hello={
            "model": spec.id,
            "model_root": served.model_root,
            "hw": {"host": handler.cheat.name, "gpu_count": 0},
            "versions": {"engy_node": "cheater"},
            "worker_name": handler.cheat.name,
            "worker_id": uuid.uuid4().hex,
        },
    )
