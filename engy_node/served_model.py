"""A served model as the gateway and the miner both see it: catalog entry, checkpoint identity,
tokenizer, and the prompt renderer.

The gateway checks the commitment's `prompt_ids` against its own rendering of the request, so
both roles must render and tokenise a conversation identically: this module is the one place
that does it, shared by every role (no role imports another's folder). The tokenizer is
transformers' own, snapshotted (`checkpoint_tokenizer`), so no role imports torch for it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engy_node.checkpoint_tokenizer import CheckpointTokenizer, load_tokenizer, return_freed_heap
from engy_node.models import ModelSpec
from engy_node.prompt_pieces import PieceEncoder
from engy_node.protocol.miner import ServeRequest


@dataclasses.dataclass(frozen=True, slots=True)
class ServedModel:
    """What a node serves: the catalog entry, its checkpoint, identity and tokenizer."""

    spec: ModelSpec
    checkpoint: Path
    model_root: str
    tokenizer: CheckpointTokenizer
    pieces: PieceEncoder
    """Tokenises rendered prompts piecewise with a cache (the tokenizer's own Rust backend)."""
    end_token_ids: frozenset[int] = frozenset()
    """Tokens that end an answer (the tokenizer's EOS and the generation config's `eos_token_id`s)."""
    max_token_bytes: int | None = None
    """Bytes of the longest text one token stands for: a text of B bytes is at least B / this
    many tokens, which lets the gateway refuse an oversized prompt without tokenising it
    (`gateway.intake`). None: the tokenizer normalises its input, and no such floor holds."""

    def ends_answer(self, output_ids: Sequence[int]) -> bool:
        """Whether committed output ids end with an end-of-answer token (a natural stop)."""
        return bool(output_ids) and output_ids[-1] in self.end_token_ids

    def render_prompt(self, request: ServeRequest) -> list[int]:
        """Token ids of the request's conversation under the checkpoint's chat template.

        The same ids as `apply_chat_template(..., tokenize=True)`, which renders the template
        and then tokenises the text without adding special tokens; here the text goes to the
        Rust tokenizer piece by piece between added tokens, remembering pieces (`prompt_pieces`):
        both the gateway and the miner do this for every request, and most of a conversation's
        pieces were there on its previous turn."""
        messages = [m.for_template() for m in request.messages]
        tools = list(request.tools) if request.tools else None
        return self.pieces.encode(
            self.tokenizer.render(
                messages, tools=tools, add_generation_prompt=True, template_kwargs=request.template_variables()
            )
        )

    def public_miner_prompts(self, request: ServeRequest) -> list[list[int]]:
        """The prompts the public one-file miners render for `request` where they differ from
        `render_prompt`'s: release 0.4.4 keeps each message's role and content only and drops
        `tools` and `chat_template_kwargs`; the newest turns each history tool call's arguments
        from a JSON string into an object before the template sees them (the Qwen3 templates
        print an object with their own spacing). An honest public miner proves one of these, not
        the gateway's prompt, when the request carries what it does not render."""
        plain = [{"role": m.role, "content": m.content} for m in request.messages]
        normalised = [_arguments_as_objects(m.for_template()) for m in request.messages]
        tools = list(request.tools) if request.tools else None
        return [
            self.pieces.encode(
                self.tokenizer.render(plain, tools=None, add_generation_prompt=True, template_kwargs={})
            ),
            self.pieces.encode(
                self.tokenizer.render(
                    normalised, tools=tools, add_generation_prompt=True, template_kwargs=request.template_variables()
                )
            ),
        ]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_served_model(
    spec: ModelSpec, checkpoint: Path, *, with_token_floor: bool = False, cache_dir: Path | None = None
) -> ServedModel:
    """Blocking (tokenizer load, shard sizes): call it through `trio.to_thread.run_sync`. The
    first load of a checkpoint takes its tokenizer snapshot in a child process
    (`checkpoint_tokenizer`; `cache_dir` moves the cache). `with_token_floor` measures
    `max_token_bytes` (a pass over the whole vocabulary): only the gateway, which refuses
    prompts by it, needs that."""
    from engy_node.models import model_root

    tokenizer = load_tokenizer(checkpoint, cache_dir=cache_dir)
    backend = tokenizer.backend_tokenizer
    floor = None
    if with_token_floor:
        floor = longest_token_bytes(backend)
        return_freed_heap()  # the pass decodes every token: ~28 MiB kept for a 151,643-token vocabulary, ~3 trimmed
    return ServedModel(
        spec=spec,
        checkpoint=checkpoint,
        model_root=model_root(checkpoint),
        tokenizer=tokenizer,
        pieces=PieceEncoder(backend),
        end_token_ids=end_token_ids_of(checkpoint, tokenizer),
        max_token_bytes=floor,
    )


def longest_token_bytes(backend: Any) -> int | None:
    """`ServedModel.max_token_bytes` of a Rust tokenizer: the longest decoded text of any id,
    added tokens included (a message that spells one is matched as that one token), plus one
    byte, since a decoder may drop a token's leading space when it decodes that token alone
    (SentencePiece's `▁`). A partial UTF-8 sequence decodes to U+FFFD, three bytes, never fewer
    than it stands for. Counted in the input's bytes: an NFC normaliser (Qwen's) shrinks a text
    to no less than a third of its bytes (three conjoining jamo, 9 bytes, compose to one 3-byte
    syllable), so it triples the figure; any other normaliser may drop bytes outright: None."""
    from tokenizers.normalizers import NFC

    shrink = {type(None): 1, NFC: 3}.get(type(backend.normalizer))
    if shrink is None:
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[token] for token in range(size)], skip_special_tokens=False)
    return shrink * (max((len(text.encode("utf-8", "surrogatepass")) for text in texts), default=0) + 1)


def end_token_ids_of(checkpoint: Path, tokenizer: Any) -> frozenset[int]:
    """The tokens that end an answer: the tokenizer's EOS and the checkpoint's configured ones."""
    ids: set[int] = set()
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    for name in ("generation_config.json", "config.json"):
        try:
            configured = json.loads((checkpoint / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for token in configured if isinstance(configured, list) else [configured]:
            if isinstance(token, int) and not isinstance(token, bool):
                ids.add(token)
    return frozenset(ids)


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return message
    fixed = []
    for call in calls:
        function = dict(call.get("function") or {}) if isinstance(call, Mapping) else {}
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                function["arguments"] = {}
        fixed.append({**call, "function": function} if isinstance(call, Mapping) else call)
    return {**message, "tool_calls": fixed}
