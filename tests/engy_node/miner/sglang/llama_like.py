"""torch modules shaped as sglang's Llama, loaded with a transformers Llama's weights, and a
stand-in sglang server over them: what the GEMM capture (`engy_node.miner.sglang.gemm_capture`)
hooks in a real sglang process, without a GPU or sglang.

The modules copy ``sglang/srt/models/llama.py``'s structure (merged ``qkv_proj`` and
``gate_up_proj`` linears returning ``(out, None)``, RMSNorms that fuse the residual add in place,
a model called with a ForwardBatch); `Scheduler` builds ForwardBatches with the fields the
capture reads. The attention between the GEMMs is transformers' own, so a request's rows are the
numbers the reference server computes for the same tokens.

`SglangStandIn` serves them over HTTP with the subset of sglang's native API that
`engy_node.serve.client.ServeClient` uses, so miner-side code can run against the capture as it
would against sglang.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from torch import nn

from engy_node.miner.sglang import gemm_capture as gc


class Linear(nn.Module):
    """sglang's QKVParallelLinear / MergedColumnParallelLinear / RowParallelLinear at tp 1, with
    batch-invariant products as under ``--enable-deterministic-inference`` (which the miner
    launches with): each request's rows are multiplied alone, so a row's bits do not depend on
    what else is in its batch (a CPU matmul's kernel follows the row count)."""

    spans: tuple[tuple[int, int], ...] = ()
    """(first row, rows) of each request in the batch running now (set by `Scheduler.run`)."""

    def __init__(self, *weights: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.cat(weights), requires_grad=False)

    def forward(self, x):
        return torch.cat([F.linear(x[row : row + count], self.weight) for row, count in self.spans]), None


class RMSNorm(nn.Module):
    """sglang's RMSNorm as its CUDA path runs: with a residual, both inputs are overwritten (the
    sum into ``residual``, the normed sum into ``x``) and returned; the norm is transformers'."""

    def __init__(self, hf_norm: nn.Module) -> None:
        super().__init__()
        self.hf_norm = hf_norm

    def forward(self, x, residual=None):
        if residual is None:
            return self.hf_norm(x)
        residual.copy_(x + residual)
        x.copy_(self.hf_norm(residual))
        return x, residual


class Attention(nn.Module):
    def __init__(self, hf_attention: nn.Module, rotary: nn.Module, layer: int) -> None:
        super().__init__()
        self.qkv_proj = Linear(hf_attention.q_proj.weight, hf_attention.k_proj.weight, hf_attention.v_proj.weight)
        self.o_proj = Linear(hf_attention.o_proj.weight)
        self.hf = hf_attention
        self.rotary = rotary
        self.layer = layer
        self.sizes = [
            hf_attention.q_proj.out_features,
            hf_attention.k_proj.out_features,
            hf_attention.v_proj.out_features,
        ]

    def forward(self, positions, hidden_states, forward_batch):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split(self.sizes, dim=-1)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.hf.config._attn_implementation, None)
        outputs = []
        for rid, row, count in forward_batch.spans:
            rows = slice(row, row + count)
            shape = (1, count, -1, self.hf.head_dim)
            qi, ki, vi = (t[rows].reshape(shape).transpose(1, 2) for t in (q, k, v))
            cos, sin = self.rotary(hidden_states[None, rows], positions[None, rows])
            qi, ki = apply_rotary_pos_emb(qi, ki, cos, sin)
            cached = forward_batch.kv.get((rid, self.layer))
            if cached is not None:
                ki, vi = torch.cat([cached[0], ki], dim=-2), torch.cat([cached[1], vi], dim=-2)
            forward_batch.kv[rid, self.layer] = (ki, vi)
            out, _ = attend(self.hf, qi, ki, vi, None, dropout=0.0, scaling=self.hf.scaling)
            outputs.append(out.reshape(count, -1))
        output, _ = self.o_proj(torch.cat(outputs).contiguous())
        return output


class MLP(nn.Module):
    def __init__(self, hf_mlp: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight)
        self.down_proj = Linear(hf_mlp.down_proj.weight)

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        half = gate_up.shape[-1] // 2
        x, _ = self.down_proj(F.silu(gate_up[..., :half]) * gate_up[..., half:])
        return x


class DecoderLayer(nn.Module):
    """sglang's LlamaDecoderLayer.forward, line for line."""

    def __init__(self, hf_layer: nn.Module, rotary: nn.Module, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(hf_layer.self_attn, rotary, index)
        self.mlp = MLP(hf_layer.mlp)
        self.input_layernorm = RMSNorm(hf_layer.input_layernorm)
        self.post_attention_layernorm = RMSNorm(hf_layer.post_attention_layernorm)

    def forward(self, positions, hidden_states, forward_batch, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states, forward_batch=forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class LlamaModel(nn.Module):
    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = nn.ModuleList(DecoderLayer(layer, inner.rotary_emb, i) for i, layer in enumerate(inner.layers))
        self.norm = RMSNorm(inner.norm)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.model = LlamaModel(hf_model)
        self.config = hf_model.config

    def forward(self, input_ids, positions, forward_batch):
        return self.model(input_ids, positions, forward_batch)


class Scheduler:
    """Builds ForwardBatches the way sglang does (the fields the capture reads) and runs them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.kv: dict = {}

    def run(self, mode: str, requests: list[tuple[str, list[int], int]]) -> torch.Tensor:
        """`requests`: (rid, tokens, position of the first) for each request of the batch.
        Returns the model's output: the final norm's rows, which sglang's lm_head reads."""
        spans, row = [], 0
        for rid, tokens, _ in requests:
            spans.append((rid, row, len(tokens)))
            row += len(tokens)
        extend = mode != "DECODE"
        batch = SimpleNamespace(
            forward_mode=SimpleNamespace(name=mode),
            rids=[rid for rid, _, _ in requests],
            extend_seq_lens_cpu=[len(t) for _, t, _ in requests] if extend else None,
            extend_prefix_lens_cpu=[p for _, _, p in requests] if extend else None,
            seq_lens_cpu=torch.tensor([p + len(t) for _, t, p in requests]),
            seq_lens=None,
            spans=spans,
            kv=self.kv,
        )
        Linear.spans = tuple((row, count) for _, row, count in spans)
        ids = torch.tensor([t for _, tokens, _ in requests for t in tokens])
        positions = torch.tensor([p + i for _, tokens, p in requests for i in range(len(tokens))])
        with torch.inference_mode():
            return self.model(ids, positions, batch)


DEFAULT_MAX_NEW_TOKENS = 128
"""sglang's default when ``sampling_params`` names no ``max_new_tokens``."""


class SglangStandIn:
    """sglang's native API over `model` (a `LlamaForCausalLM`), for tests: ``POST /generate``,
    ``GET /get_server_info``, ``GET /get_load``, ``POST /abort_request`` and ``GET /health``,
    answering in sglang's shapes. It is not a model server to measure anything against:

    * Decoding is greedy whatever ``sampling_params`` say (only ``max_new_tokens`` is read), so
      an answer is reproducible; it stops at ``max_new_tokens`` or the model's eos token
      (included in ``output_ids``, as sglang does). ``text`` is always empty: no tokenizer.
    * Each request runs alone, as sglang's scheduler would run it by itself: its prompt as one
      EXTEND batch from position 0, then one DECODE batch per later token, with its own rid in
      the batch (so a capture records rids starting ``engy-gemm-``) and its own KV cache. Token 0
      comes from the prefill and every decode step feeds the previous token, so N tokens take
      N − 1 decode steps and the last is never fed back — the rows a capture holds for N tokens
      are sglang's. Passes of concurrent requests take turns under one lock: `Linear.spans` and
      the capture's per-pass plan are shared by all of them.
    * ``meta_info.hidden_states`` (with ``return_hidden_states``) is sglang's ragged list: the
      prefill block (one row per prompt token), then one row per decode step; each row is what
      the lm_head read, as float32. Streams (``"stream": true``) send the cumulative result after
      every token, then ``[DONE]``. ``output_token_logprobs`` (with ``return_logprob``) has
      sglang's ``[logprob, id, null]`` entries; input logprobs are left out.
    * Nothing is validated. Every ``/generate`` body is kept in `bodies` and every rid asked to
      abort in `aborted` (the generation is not stopped), so a test asserts what was sent.
    * `/get_server_info` has no ``gemm_commitments``: sglang's has none.

    With `capture`, the stand-in is an sglang launched with the capture armed: `run` attaches it
    to `model` and starts its loopback opening server (`gemm_capture.serve`, at `capture_url`),
    and undoes both when it stops.
    """

    def __init__(self, model: LlamaForCausalLM, hf_model: Any, *, capture: gc.SglangCapture | None = None) -> None:
        self.model = model
        self.lm_head = hf_model.lm_head
        eos = hf_model.config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else eos or ())
        self.capture = capture
        self.bodies: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.url = ""
        self.capture_url = ""
        self._lock = threading.Lock()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve on a free loopback port until cancelled; ready (`url` set, and `capture_url`
        with a capture) when `task_status.started(url)` is called."""
        app = Starlette(
            routes=[
                Route("/generate", self.generate, methods=["POST"]),
                Route("/get_server_info", self.server_info, methods=["GET"]),
                Route("/get_load", self.load, methods=["GET"]),
                Route("/abort_request", self.abort, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
            ]
        )
        config = HypercornConfig()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        handles, openings = [], None
        try:
            if self.capture is not None:
                handles = self.capture.attach(self.model)
                openings = gc.serve(self.capture, 0)
                self.capture_url = f"http://127.0.0.1:{openings.server_address[1]}"
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(hypercorn_serve, app, config)
                self.url = binds[0]
                task_status.started(self.url)
        finally:
            for handle in handles:
                handle.remove()
            if openings is not None:
                openings.shutdown()
                openings.server_close()

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        results = self._results(body)
        if body.get("stream"):
            return StreamingResponse(_events(results), media_type="text/event-stream")
        final: dict[str, Any] = {}
        async for result in results:
            final = result
        return JSONResponse(final)

    async def _results(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The request's cumulative result after each generated token; the last one finished."""
        rid, prompt = body["rid"], list(body["input_ids"])
        most = (body.get("sampling_params") or {}).get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        scheduler = Scheduler(self.model)
        output: list[int] = []
        logprobs: list[list[Any]] = []
        hidden: list[Any] = []
        finish: dict[str, Any] | None = None
        mode, fed = "EXTEND", prompt
        while finish is None:
            position = len(prompt) + len(output) - 1 if output else 0
            rows, token, logprob = await trio.to_thread.run_sync(self._step, scheduler, rid, mode, fed, position)
            output.append(token)
            logprobs.append([logprob, token, None])
            hidden.append(rows if mode == "EXTEND" else rows[0])
            if token in self.eos_ids:
                finish = {"type": "stop", "matched": token}
            elif len(output) >= most:
                finish = {"type": "length", "length": most}
            meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt)}
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = list(logprobs)
            meta |= {"completion_tokens": len(output), "cached_tokens": 0}
            if body.get("return_hidden_states"):
                meta["hidden_states"] = list(hidden)
            yield {"text": "", "output_ids": list(output), "meta_info": meta}
            mode, fed = "DECODE", [token]

    def _step(
        self, scheduler: Scheduler, rid: str, mode: str, tokens: list[int], position: int
    ) -> tuple[list[list[float]], int, float]:
        """One forward pass of `rid` alone: (its rows as float32 lists, the greedy next token, that
        token's logprob). Runs on a worker thread."""
        with self._lock, torch.inference_mode():
            rows = scheduler.run(mode, [(rid, tokens, position)])
            logits = self.lm_head(rows[-1:]).float()[0]
            token = int(logits.argmax())
            return rows.float().tolist(), token, float(torch.log_softmax(logits, -1)[token])

    async def server_info(self, request: Request) -> Response:
        return JSONResponse({"max_total_num_tokens": 65536, "version": "stand-in"})

    async def load(self, request: Request) -> Response:
        return JSONResponse([])

    async def abort(self, request: Request) -> Response:
        self.aborted.append((await request.json()).get("rid", ""))
        return JSONResponse({})

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)


async def _events(results: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """sglang's SSE stream: one ``data:`` event per result, then ``data: [DONE]``."""
    async for result in results:
        yield b"data: " + json.dumps(result).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
