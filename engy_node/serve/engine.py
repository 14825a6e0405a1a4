"""Run a causal LM the way sglang's scheduler does, small enough to read in one sitting.

`ModelRunner` owns the weights and does the arithmetic: chunked prefill and one-token decode
steps over a per-request KV cache, returning the final hidden state (post final norm, the
lm_head input — what sglang's `return_hidden_states` returns) and the logits. It has no threads
and no queue, so the verifier and the calibration tests drive it directly.

`Generation` is one request's state and its step function; `Engine` runs many of them in one
worker thread: it admits up to `max_running` requests, then round-robins one step per request
(interleaved continuous decoding; a long prompt is prefilled in chunks so it cannot stall the
others for long). Between steps it honours aborts, so cancelling one request never waits
behind another's generation. All torch work stays on that one thread: the model is not shared
between threads, and the event loop never blocks on a forward pass.

Failure posture: a request that raises inside a step finishes with an `abort` carrying the error
(the others continue); if the thread itself dies, every waiting and running request is failed
and `healthy` turns false, which /health reports.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from engy_node.serve.sampling import REPLACEMENT_CHARACTER, SamplingParams, choose_token, find_stop, stream_holdback

log = logging.getLogger("engy.serve.engine")

PREFILL_CHUNK_TOKENS = 512
"""Prompt tokens per prefill step. Bounds how long one long prompt holds the thread (about
0.3 s for SmolLM2 on two CPU cores) before the other running requests get their next token."""

THROUGHPUT_WINDOW_S = 10.0
"""`/server_info`'s last_gen_throughput averages over this window."""

IDLE_WAIT_S = 0.5
"""How long the idle thread sleeps between checks for stop when no work arrives."""


PREFIX_CACHE_MIN_TOKENS = 16
"""A shared prefix shorter than this is prefilled again: reusing it would save little."""


class PrefixCache:
    """KV caches of recent sequences, reused by a request whose prompt starts the same way:
    sglang's radix cache, in miniature. A multi-turn conversation resends its history, a
    system prompt or a tool list opens many requests, and a probe corpus repeats: their shared
    prefix is prefilled once. Each kept sequence is the prompt and the answer of one finished
    request (what its cache held when it ended); a new prompt takes the longest common prefix
    with any of them, as a copy cut to that length, and prefills only the rest (at least its
    last token, whose logits choose the first output token). Bounded in tokens, least recently
    used first out. Engine-thread only: no lock."""

    def __init__(self, runner: ModelRunner, *, max_tokens: int) -> None:
        self.runner = runner
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[tuple[int, ...], Any] = collections.OrderedDict()
        self._tokens = 0
        self.hit_tokens = 0
        self.prompt_tokens = 0

    def take(self, ids: Sequence[int], longest: int | None = None) -> tuple[int, Any] | None:
        """(prefix length, a cache holding that prefix) for the best match of `ids` (at most
        `longest` tokens of it), or None."""
        self.prompt_tokens += len(ids)
        limit = len(ids) - 1 if longest is None else min(len(ids) - 1, longest)
        best, best_key = 0, None
        for key in self._entries:
            shared = _common_prefix(key, ids, limit)
            if shared > best:
                best, best_key = shared, key
        if best_key is None or best < PREFIX_CACHE_MIN_TOKENS:
            return None
        self._entries.move_to_end(best_key)
        self.hit_tokens += best
        return best, self._clone(self._entries[best_key], best)

    def keep(self, ids: Sequence[int], cache: Any) -> None:
        """Remember `cache`, which holds the KV of exactly `ids`."""
        key = tuple(ids)
        if not PREFIX_CACHE_MIN_TOKENS <= len(key) <= self.max_tokens:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = self._clone(cache, len(key))
        self._tokens += len(key)
        while self._tokens > self.max_tokens:
            evicted, _ = self._entries.popitem(last=False)
            self._tokens -= len(evicted)

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def _clone(self, cache: Any, length: int) -> Any:
        copy = self.runner.new_cache()
        for index, layer in enumerate(cache.layers):
            copy.update(layer.keys[:, :, :length, :].clone(), layer.values[:, :, :length, :].clone(), index)
        return copy


def _common_prefix(key: tuple[int, ...], ids: Sequence[int], limit: int) -> int:
    end = min(len(key), limit)
    if tuple(ids[:end]) == key[:end]:
        return end
    low, high = 0, end  # the first `low` agree; somewhere before `high` they part
    while low + 1 < high:
        middle = (low + high) // 2
        if tuple(ids[low:middle]) == key[low:middle]:
            low = middle
        else:
            high = middle
    return low


class RequestError(ValueError):
    """The request cannot be run as given (too long, bad ids); sent back as a 400."""


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RequestError("device 'cuda' requested but torch sees no GPU; use --device cpu")
    return device


class ModelRunner:
    """Weights, tokenizer and the two forward passes a generation needs."""

    def __init__(self, model, tokenizer, *, checkpoint: Path, device: str, dtype: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.checkpoint = checkpoint
        self.device = device
        self.dtype = dtype
        config = model.config
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 8192)
        self.eos_token_ids = self._eos_ids()
        # transformers renamed `past_key_values` to `cache` during 5.x; accept either.
        parameters = inspect.signature(model.model.forward).parameters
        self._cache_keyword = "cache" if "cache" in parameters else "past_key_values"

    @classmethod
    def load(cls, checkpoint: Path, *, device: str = "auto", dtype: str = "bfloat16") -> ModelRunner:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from engy_node.serve.capture import exact_arithmetic

        device = _resolve_device(device)
        exact_arithmetic()  # what the GEMM audit's tolerance assumes (serve.capture)
        torch_dtype = getattr(torch, dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch_dtype)
        # transformers wraps `to` with functools.wraps, which mypy types as an unbound function.
        model.to(device)  # type: ignore[arg-type]
        model.eval()
        return cls(model, tokenizer, checkpoint=checkpoint, device=device, dtype=dtype)

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.model.config, getattr(self.model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def forward(self, token_ids: Sequence[int], cache, capture=None) -> tuple[Any, Any]:
        """Run `token_ids` after what `cache` holds; returns (hidden rows [n, H], logits of the
        last row [V]) in the model's dtype and float32. A `capture` (serve.capture) records the
        decoder layers' GEMMs."""
        import torch

        from engy_node.serve.capture import release

        if capture is None:
            release(self.model)  # a captured request's wrappers stay set between its calls
        recording = capture.recording(self.model) if capture is not None else contextlib.nullcontext()
        with torch.inference_mode(), recording:
            inputs = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
            hidden = self.model.model(
                input_ids=inputs, **{self._cache_keyword: cache}, use_cache=True
            ).last_hidden_state[0]
            logits = self.model.lm_head(hidden[-1:]).float()[0]
        return hidden, logits

    def prefill(self, token_ids: Sequence[int], *, chunk_tokens: int = 2048, start: int = 0) -> tuple[Any, Any]:
        """Final hidden states [n - start, H] and logits [n - start, V] (float32) at the positions
        of `token_ids` from `start` on, in one cold pass over all of them. The verifier's
        recompute: it reads only the positions that predict output tokens, so the lm_head (a
        fifth of a small model's work per position) runs, and its logits are widened, only there.
        A matmul over fewer rows may round a logit differently in its last place (its kernel
        follows the row count, as it already does the prompt's length)."""
        import torch

        if not token_ids:
            raise RequestError("prefill needs at least one token")
        if not 0 <= start < len(token_ids):
            raise RequestError(f"prefill start {start} is outside the {len(token_ids)} positions")
        self.check_ids(token_ids)
        cache = self.new_cache()
        hidden_parts, logit_parts = [], []
        with torch.inference_mode():
            for first in range(0, len(token_ids), chunk_tokens):
                piece = torch.tensor(
                    [list(token_ids[first : first + chunk_tokens])], dtype=torch.long, device=self.device
                )
                hidden = self.model.model(
                    input_ids=piece, **{self._cache_keyword: cache}, use_cache=True
                ).last_hidden_state[0]
                if first + len(hidden) > start:
                    hidden = hidden[max(0, start - first) :]
                    hidden_parts.append(hidden)
                    logit_parts.append(self.model.lm_head(hidden).float())
        if len(hidden_parts) == 1:  # one chunk, the usual case: nothing to copy
            return hidden_parts[0], logit_parts[0]
        return torch.cat(hidden_parts), torch.cat(logit_parts)

    def check_ids(self, token_ids: Sequence[int]) -> None:
        bad = next(
            (t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size),
            None,
        )
        if bad is not None:
            raise RequestError(f"token id {bad!r} is outside the vocabulary (0..{self.vocab_size - 1})")

    def decode_text(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


@dataclasses.dataclass
class Generation:
    """One request: its inputs, its growing outputs, and how it finished.

    Written only by the engine thread. Readers on other threads see a consistent prefix:
    lists only grow (appends are atomic), and `version` is bumped after each step's appends."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_hidden_states: bool = False
    return_logprob: bool = False
    created_at: float = dataclasses.field(default_factory=time.time)
    created_perf: float = dataclasses.field(default_factory=time.perf_counter)

    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    hidden_block: Any = None
    """Final hidden states of the prompt positions [P, H] (the prefill block)."""
    hidden_rows: list[Any] = dataclasses.field(default_factory=list)
    """One decode vector [H] per output token after the first."""
    text: str = ""
    """Decoded output so far, stop strings trimmed."""
    _visible: str = ""
    """The part of `text` an unfinished generation may stream. One attribute, so a reader on
    another thread never pairs a new text with the previous token's hold-back."""
    finish_reason: dict[str, Any] | None = None
    first_token_perf: float | None = None
    last_token_perf: float | None = None
    finished_perf: float | None = None
    version: int = 0

    abort_requested: str | None = None
    on_update: Callable[[Generation], None] | None = None
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache instead of a prefill."""
    on_finish: Callable[[list[int], Any], None] | None = None
    """Called with the tokens the KV cache holds and the cache, when the generation ends."""
    capture: Any = None
    """The GEMM-audit capture (serve.capture.ActivationCapture) of a request that asked for it."""
    gemm_commitment: dict[str, Any] | None = None
    """Its commitment, set before the generation reads as finished."""
    _cache: Any = None
    _prefilled: int = 0
    _generator: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def visible_text(self) -> str:
        """What a stream may show now: all of `text` once finished; before that, `text` less a
        tail a later token may still change (`stream_holdback`), so each visible text is a
        prefix of the next and of the final text."""
        return self.text if self.finished else self._visible

    @property
    def hidden_states_count(self) -> int:
        return (1 if self.hidden_block is not None else 0) + len(self.hidden_rows)

    def finish(self, reason: dict[str, Any]) -> None:
        if self.finish_reason is None:
            if self.capture is not None and reason.get("type") != "abort":
                self.gemm_commitment = self.capture.commit(self.rid)
            elif self.capture is not None:
                self.capture.close()
            self.finish_reason = reason
            self.finished_perf = time.perf_counter()
            if self.on_finish is not None and self._cache is not None:
                # The last output token was never fed back, so the cache holds the rest.
                held = self.input_ids[: self._prefilled] + (
                    self.output_ids[:-1] if self._prefilled == len(self.input_ids) else []
                )
                self.on_finish(held, self._cache)
            self._cache = None

    def resume_from(self, prefix: int, cache: Any) -> None:
        """Start from a cache that already holds the first `prefix` prompt tokens."""
        self._cache = cache
        self._prefilled = self.cached_tokens = prefix

    def step(self, runner: ModelRunner) -> None:
        """Advance by one unit of work: a prefill chunk or one decoded token."""
        import torch

        if self.finished:
            return
        if self._generator is None:
            # Unseeded draws only: a seeded request is sampled from its seed (sampling.seeded_choice).
            self._generator = torch.Generator(device=runner.device)
            self._generator.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        if self._cache is None:
            self._cache = runner.new_cache()

        if self._prefilled < len(self.input_ids):
            start = self._prefilled
            chunk = self.input_ids[start : start + PREFILL_CHUNK_TOKENS]
            hidden, logits = runner.forward(chunk, self._cache, self.capture)
            self._prefilled += len(chunk)
            if self.return_hidden_states:
                self.hidden_block = hidden if self.hidden_block is None else torch.cat([self.hidden_block, hidden])
            if self._prefilled < len(self.input_ids):
                return
            if self.params.max_new_tokens == 0:
                self.finish({"type": "length", "length": 0})
                return
        else:
            hidden, logits = runner.forward(self.output_ids[-1:], self._cache, self.capture)
            if self.return_hidden_states:
                self.hidden_rows.append(hidden[-1])
        # sglang's sampling position: the last token the model has seen (sequence length - 1).
        position = len(self.input_ids) + len(self.output_ids) - 1
        token, logprob = choose_token(logits, self.params, self.output_ids, self._generator, position=position)
        self._accept(runner, token, logprob)

    def _accept(self, runner: ModelRunner, token: int, logprob: float) -> None:
        now = time.perf_counter()
        if self.first_token_perf is None:
            self.first_token_perf = now
        self.last_token_perf = now
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        params = self.params
        produced = len(self.output_ids)

        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else runner.eos_token_ids)
        if token in stop_ids and produced > params.min_new_tokens:
            self.text = runner.decode_text(self.output_ids[:-1], skip_special_tokens=params.skip_special_tokens)
            self.finish({"type": "stop", "matched": token})
            return
        full_text = runner.decode_text(self.output_ids, skip_special_tokens=params.skip_special_tokens)
        if params.stop and produced > params.min_new_tokens:
            # The new decode extends the last one up to its trailing U+FFFD run (UTF-8 is
            # self-synchronising: only an incomplete last character changes). Text before that
            # was searched at the last token, or decoded while min_new_tokens kept stops off and
            # perhaps streamed, so only a stop string ending past it counts; such a match starts
            # at or after the streamed text, which stream_holdback kept clear of stop prefixes.
            settled = len(self.text.rstrip(REPLACEMENT_CHARACTER))
            match = find_stop(full_text, params.stop, ends_after=settled)
            if match is not None:
                self.text = full_text if params.no_stop_trim else full_text[: match.index]
                self.finish({"type": "stop", "matched": match.matched})
                return
        self.text = full_text
        if produced >= params.max_new_tokens:
            self.finish({"type": "length", "length": params.max_new_tokens})
            return
        self._visible = full_text[: len(full_text) - stream_holdback(full_text, params.stop)]

    def hidden_states_tensors(self) -> list[Any]:
        """The ragged list sglang returns: [prefill block, v_1, …, v_{n-1}]."""
        return ([self.hidden_block] if self.hidden_block is not None else []) + list(self.hidden_rows)

    def proof_rows(self):
        """One final hidden state per output token, in order: the prefill block's last row
        (which produced token 0), then each decode vector. This is what TOPLOC commits to."""
        import torch

        if self.hidden_block is None or not self.output_ids:
            raise RequestError("no hidden states were captured for this generation")
        return torch.stack([self.hidden_block[-1], *self.hidden_rows])


def run_to_completion(runner: ModelRunner, generation: Generation) -> Generation:
    """Drive one generation on the calling thread (tests, calibration, offline tools)."""
    while not generation.finished:
        generation.step(runner)
    return generation


@dataclasses.dataclass
class _Job:
    """Work other than decoding that must run on the engine thread (a verifier prefill)."""

    work: Callable[[ModelRunner], Any]
    done: Callable[[Any, BaseException | None], None]


class Engine:
    """The scheduler thread around a `ModelRunner` (see the module docstring)."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_running: int = 8,
        request_timeout_s: float = 1800.0,
        metrics: EngineMetrics | None = None,
        prefix_cache_tokens: int = 0,
    ) -> None:
        self.runner = runner
        self.prefix_cache = PrefixCache(runner, max_tokens=prefix_cache_tokens) if prefix_cache_tokens else None
        self.max_running = max_running
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self._inbox: queue.SimpleQueue[Generation | _Job | None] = queue.SimpleQueue()
        self._waiting: list[Generation] = []
        self._running: list[Generation] = []
        self._live: dict[int, Generation] = {}
        """Every submitted, unfinished generation, wherever it is (inbox, waiting, running)."""
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.healthy = True
        self.last_step_at = 0.0
        self.steps = 0
        self.tokens_generated = 0
        self._recent_tokens: collections.deque[tuple[float, int]] = collections.deque()
        """(time, tokens) of the last THROUGHPUT_WINDOW_S; pruned as it grows."""

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engy-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.healthy

    # ---- requests (any thread) -------------------------------------------------------------
    def submit(self, generation: Generation) -> None:
        runner = self.runner
        runner.check_ids(generation.input_ids)
        if not generation.input_ids:
            raise RequestError("the request has no input tokens")
        needed = len(generation.input_ids) + generation.params.max_new_tokens
        if needed > runner.context_length:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{runner.context_length} tokens. You requested a total of {needed} tokens: "
                f"{len(generation.input_ids)} tokens from the input messages and "
                f"{generation.params.max_new_tokens} tokens for the completion. Please reduce "
                f"the number of tokens in the input messages or the completion to fit within the limit."
            )
        if not self.alive:
            raise RequestError("the engine is not running")
        with self._lock:
            self._live[id(generation)] = generation
        self._inbox.put(generation)

    def run_job(self, work: Callable[[ModelRunner], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        """Run `work(runner)` on the engine thread between steps; `done(result, error)` after."""
        self._inbox.put(_Job(work, done))

    def abort(self, rid: str = "", *, prefix: bool = True, abort_all: bool = False, message: str = "Aborted") -> int:
        """Mark matching unfinished requests for abort (sglang matches rids by prefix); the
        thread finishes them before their next step. Returns how many were marked."""
        if not rid and not abort_all:
            return 0
        count = 0
        with self._lock:
            for generation in self._live.values():
                matches = abort_all or (generation.rid.startswith(rid) if prefix else generation.rid == rid)
                if matches and not generation.finished and generation.abort_requested is None:
                    generation.abort_requested = message
                    count += 1
        return count

    def load(self) -> tuple[int, int]:
        with self._lock:
            return len(self._running), len(self._waiting)

    def kv_load(self) -> dict[str, int]:
        """The KV cache and queue as sglang's `/get_load` reports one rank's: tokens the running
        requests hold (prompt and output so far), requests running and waiting, and the prompt
        tokens waiting to be prefilled. The prefix cache is left out: it gives way to requests."""
        with self._lock:
            return {
                "num_reqs": len(self._running),
                "num_waiting_reqs": len(self._waiting),
                "num_tokens": sum(len(g.input_ids) + len(g.output_ids) for g in self._running),
                "num_pending_tokens": sum(len(g.input_ids) for g in self._waiting),
            }

    def flush_cache(self) -> None:
        """Empty the prefix cache, on the engine thread between steps."""
        cache = self.prefix_cache
        if cache is not None:
            self.run_job(lambda runner: cache.clear(), lambda result, error: None)

    def gen_throughput(self) -> float:
        """Tokens per second over the last THROUGHPUT_WINDOW_S."""
        with self._lock:
            self._prune_recent(time.perf_counter())
            return sum(n for _, n in self._recent_tokens) / THROUGHPUT_WINDOW_S

    def _prune_recent(self, now: float) -> None:
        while self._recent_tokens and now - self._recent_tokens[0][0] > THROUGHPUT_WINDOW_S:
            self._recent_tokens.popleft()

    # ---- the thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_inbox(block=not self._running and not self._waiting)
                self._admit()
                for generation in list(self._running):
                    self._step(generation)
                self._retire()
                if self.metrics is not None:
                    running, waiting = self.load()
                    self.metrics.set_load(running, waiting)
        except BaseException as error:  # broad on purpose: the thread must fail every request
            self.healthy = False
            log.exception("engine thread died: %s", type(error).__name__)
            with self._lock:
                victims = list(self._live.values())
                self._waiting, self._running, self._live = [], [], {}
            for generation in victims:
                generation.finish(
                    {
                        "type": "abort",
                        "message": f"engine failure: {type(error).__name__}",
                        "status_code": 500,
                        "err_type": "InternalServerError",
                    }
                )
                self._notify(generation)
            raise

    def _drain_inbox(self, *, block: bool) -> None:
        first = True
        while True:
            try:
                item = self._inbox.get(timeout=IDLE_WAIT_S) if block and first else self._inbox.get_nowait()
            except queue.Empty:
                return
            first = False
            if item is None:
                return
            if isinstance(item, _Job):
                self._run_job(item)
                continue
            with self._lock:
                self._waiting.append(item)

    def _run_job(self, job: _Job) -> None:
        try:
            result = job.work(self.runner)
        except Exception as error:  # broad on purpose: the job's caller gets the error
            job.done(None, error)
        else:
            job.done(result, None)

    def _admit(self) -> None:
        with self._lock:
            for generation in list(self._waiting):
                if generation.abort_requested is not None:
                    self._waiting.remove(generation)
                    generation.finish({"type": "abort", "message": "Abort in waiting queue"})
                    self._live.pop(id(generation), None)
                    self._notify(generation)
                    self._count_abort()
            while self._waiting and len(self._running) < self.max_running:
                generation = self._waiting.pop(0)
                if self.prefix_cache is not None:
                    # A committed answer's cached prefix must end inside the buyer's prompt: a
                    # later chunk of a long answer re-sends its output too (serve.client).
                    longest = None if generation.capture is None else generation.capture.commit_from_at_most
                    hit = self.prefix_cache.take(generation.input_ids, longest)
                    if hit is not None:
                        generation.resume_from(*hit)
                        if generation.capture is not None:
                            # The cached positions were committed by the answer that computed them.
                            generation.capture.start_at(hit[0])
                    generation.on_finish = self.prefix_cache.keep
                self._running.append(generation)

    def _step(self, generation: Generation) -> None:
        if (
            generation.abort_requested is None
            and time.perf_counter() - generation.created_perf > self.request_timeout_s
        ):
            log.warning("request %s ran past %.0f s; aborting it", generation.rid, self.request_timeout_s)
            generation.abort_requested = "Request timed out"
        if generation.abort_requested is not None:
            generation.finish(
                {"type": "abort", "message": generation.abort_requested, "status_code": None, "err_type": None}
            )
            self._count_abort()
            self._notify(generation)
            return
        before = len(generation.output_ids)
        previous_token = generation.last_token_perf
        try:
            generation.step(self.runner)
        except Exception as error:  # broad on purpose: one bad request must not stop the others
            log.exception("request %s failed in the engine", generation.rid)
            generation.finish(
                {
                    "type": "abort",
                    "message": f"{type(error).__name__}: {error}",
                    "status_code": 500,
                    "err_type": "InternalServerError",
                }
            )
        self.steps += 1
        self.last_step_at = time.time()
        produced = len(generation.output_ids) - before
        if produced:
            self.tokens_generated += produced
            with self._lock:
                now = time.perf_counter()
                self._recent_tokens.append((now, produced))
                self._prune_recent(now)
            if self.metrics is not None:
                self.metrics.observe_token(generation, previous_token)
        if produced or generation.finished:
            self._notify(generation)

    def _retire(self) -> None:
        with self._lock:
            done = [g for g in self._running if g.finished]
            self._running = [g for g in self._running if not g.finished]
            for generation in done:
                self._live.pop(id(generation), None)
        if self.metrics is not None:
            for generation in done:
                self.metrics.observe_finish(generation)

    def _count_abort(self) -> None:
        if self.metrics is not None:
            self.metrics.aborted()

    @staticmethod
    def _notify(generation: Generation) -> None:
        generation.version += 1
        if generation.on_update is not None:
            try:
                generation.on_update(generation)
            except Exception:  # broad on purpose: a dead listener must not kill the engine
                log.exception("update listener for %s failed", generation.rid)


async def run_on_engine(engine: Engine, work) -> Any:
    """Run `work(runner)` on the engine thread and await its result without blocking trio."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    outcome: dict[str, Any] = {}

    def finished(result: Any, error: BaseException | None) -> None:
        outcome["result"], outcome["error"] = result, error
        token.run_sync_soon(done.set)

    engine.run_job(work, finished)
    await done.wait()
    if outcome["error"] is not None:
        raise outcome["error"]
    return outcome["result"]


class EngineMetrics:
    """sglang's metric names, so a dashboard or scraper written for sglang reads ours unchanged."""

    def __init__(self, registry, *, model_name: str) -> None:
        from engy_node.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

        labels = {"model_name": model_name, "engine_type": "unified"}
        self._labels = labels
        self.ttft = registry.histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labelnames=("model_name", "engine_type"),
            buckets=TTFT_BUCKETS,
        ).labels(**labels)
        self.itl = registry.histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labelnames=("model_name", "engine_type"),
            buckets=ITL_BUCKETS,
        ).labels(**labels)
        self.e2e = registry.histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            labelnames=("model_name", "engine_type"),
            buckets=E2E_BUCKETS,
        ).labels(**labels)
        self.running = registry.gauge(
            "sglang:num_running_reqs", "The number of running requests.", labelnames=("model_name", "engine_type")
        ).labels(**labels)
        self.queued = registry.gauge(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            labelnames=("model_name", "engine_type"),
        ).labels(**labels)
        self.prompt_tokens = registry.counter(
            "sglang:prompt_tokens_total",
            "Number of prefill tokens processed.",
            labelnames=("model_name", "engine_type"),
        ).labels(**labels)
        self.generation_tokens = registry.counter(
            "sglang:generation_tokens_total",
            "Number of generation tokens processed.",
            labelnames=("model_name", "engine_type"),
        ).labels(**labels)
        self.requests = registry.counter(
            "sglang:num_requests_total", "Number of requests processed.", labelnames=("model_name", "engine_type")
        ).labels(**labels)
        self.aborts = registry.counter(
            "sglang:num_aborted_requests_total", "Number of requests aborted.", labelnames=("model_name", "engine_type")
        ).labels(**labels)

    def set_load(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.queued.set(waiting)

    def observe_token(self, generation: Generation, previous_token_perf: float | None) -> None:
        self.generation_tokens.inc()
        now = generation.last_token_perf or time.perf_counter()
        if previous_token_perf is None:
            self.ttft.observe(now - generation.created_perf)
        else:
            self.itl.observe(now - previous_token_perf)

    def observe_finish(self, generation: Generation) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(len(generation.input_ids))
        end = generation.finished_perf or time.perf_counter()
        self.e2e.observe(end - generation.created_perf)

    def aborted(self) -> None:
        self.aborts.inc()
