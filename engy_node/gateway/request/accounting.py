"""An answer measured against its proof: what the buyer is billed and given, and what the audit
judges (docs/billing.md).

A miner streams text and, at its end, commits to the token ids it computed. These functions read
one against the other: how many completion tokens the buyer received (`relayed_tokens`,
`structured_relayed_tokens` for an answer sent in parts), whether the text is what the proven
tokens decode to, or differs only in presentation (`corrections.presentation_match`), where an
answer ended at a stop string, how many tokens are reasoning (`reasoning_tokens`), and what a
miner claims beyond its commitment (`usage_padding`). The claim of an unproven answer
(`cache_claim`) can only lower the bill.

No IO and no clock: plain functions over a `ServedModel`'s tokenizer. Those marked blocking decode
or tokenise, so `accountant.Accountant` runs them off the event loop when the text is large.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypedDict

from engy_node.gateway.request.corrections import StructuredParts, presentation_match, structured_account
from engy_node.model_output import THINK_CLOSE, ReasoningDelta, parse_output
from engy_node.protocol.miner import Response
from engy_node.serve.sampling import REPLACEMENT_CHARACTER
from engy_node.served_model import ServedModel


def cache_claim(response: Response | None, relayed_tokens: int) -> dict[str, Any] | None:
    """An unproven answer's claim: the miner's cached-token count (a TEE miner reports its
    serve's cache reads with `commitment: {}`), which can only lower the bill, and the relayed
    completion as its completion, since a count that is no proof's must not lower it."""
    output = response.output if response is not None else None
    usage = output.get("usage") if isinstance(output, dict) else None
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens_details"), dict):
        return None
    return {
        "usage": {"completion_tokens": relayed_tokens, "prompt_tokens_details": usage["prompt_tokens_details"]},
        "committed_completion": relayed_tokens,
    }


class StopTerms(TypedDict):
    """How an answer ended, as `relayed_tokens` and `structured_relayed_tokens` take it."""

    stops: Sequence[str]
    cut_at: str | None
    finish_stop: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Relayed:
    """What the miner sent, measured against the committed output."""

    tokens: int
    """Completion tokens to bill: all committed ones when the buyer is given the whole proven
    answer (the end token as the end of the answer); otherwise the text up to the stop recounted."""
    output_ids: tuple[int, ...]
    """The delivery as token ids (`proof.Delivery.relayed_output_ids`): the committed ids, or the
    shortest prefix of them that covers an answer ended at a stop string; for text that is not
    what they decode to, that text's own tokenisation (which then disagrees)."""
    proved: bool
    """The miner's text is what the committed ids decode to, or a prefix of it, or differs from
    that only in presentation (`corrections.presentation_match`)."""
    stop: str | None
    """The stop string the answer ended at: where the gateway cut it, or where the committed
    output goes on past the miner's text with one of the request's stop strings."""
    proven_text: str | None = None
    """The decode of the proven tokens, as far as the answer goes: what the buyer is given."""
    defect: str | None = None
    """How the miner's text differs from `proven_text` when it is proved but not equal:
    `held-back` (a tail it never sent), `whitespace`, `replacement-character` (U+FFFD for a
    character it did not wait for)."""


def relayed_tokens(
    model: ServedModel,
    miner_text: str,
    output_ids: list[int],
    *,
    stops: Sequence[str],
    cut_at: str | None,
    finish_stop: bool,
) -> Relayed:
    """Blocking (decodes and tokenises): measure a miner's text against its committed output ids."""
    committed_text = model.decode(output_ids)
    if committed_text == miner_text and cut_at is None:
        return Relayed(
            tokens=len(output_ids), output_ids=tuple(output_ids), proved=True, stop=None, proven_text=committed_text
        )
    covered = (
        len(miner_text) if committed_text.startswith(miner_text) else presentation_match(miner_text, committed_text)
    )
    if covered is None:
        return _unproved(model, miner_text, output_ids, cut_at=cut_at, finish_stop=finish_stop)
    rest = committed_text[covered:]
    stop = cut_at if cut_at is not None else next((s for s in stops if s and rest.lstrip().startswith(s)), None)
    if stop is None:
        # The whole proven answer goes to the buyer, whatever part of it the miner's text lacked.
        return Relayed(
            tokens=len(output_ids),
            output_ids=tuple(output_ids),
            proved=True,
            stop=None,
            proven_text=committed_text,
            defect=_defect(miner_text, committed_text, covered),
        )
    proven = committed_text[:covered]
    tokens = len(model.tokenizer.encode(proven, add_special_tokens=False) if proven else []) + (
        1 if finish_stop and output_ids else 0
    )
    return Relayed(
        tokens=tokens,
        output_ids=_covering_prefix(model, output_ids, proven),
        proved=True,
        stop=stop,
        proven_text=proven,
        defect=_defect(miner_text, proven, covered),
    )


def structured_relayed_tokens(
    model: ServedModel,
    miner_text: str,
    output_ids: list[int],
    *,
    parts: StructuredParts,
    tools: Sequence[dict[str, Any]] | None,
    stops: Sequence[str],
    cut_at: str | None,
    finish_stop: bool,
) -> Relayed:
    """Blocking: `relayed_tokens` for a miner that sent its answer in parts (`miner_text` is its
    text alone): the parts are measured against the proven text read into parts
    (`corrections.structured_account`), and the relayed tokens are those of the proven text
    they account for."""
    account = structured_account(miner_text, parts, model.decode(output_ids), tools=tools)
    if account is None:
        return _unproved(model, miner_text, output_ids, cut_at=cut_at, finish_stop=finish_stop)
    relay = relayed_tokens(model, account.text, output_ids, stops=stops, cut_at=cut_at, finish_stop=finish_stop)
    # Text that ends at a stop string was not held back: it ended there.
    defect = None if account.defect == "held-back" and relay.stop is not None else account.defect
    return dataclasses.replace(relay, defect=defect or relay.defect) if relay.proved else relay


def _unproved(
    model: ServedModel, miner_text: str, output_ids: list[int], *, cut_at: str | None, finish_stop: bool
) -> Relayed:
    relayed_ids = model.tokenizer.encode(miner_text, add_special_tokens=False) if miner_text else []
    return Relayed(
        tokens=len(relayed_ids) + (1 if finish_stop and output_ids else 0),
        output_ids=tuple(relayed_ids),
        proved=False,
        stop=cut_at,
    )


def _defect(miner_text: str, proven: str, covered: int) -> str | None:
    if miner_text == proven:
        return None
    if REPLACEMENT_CHARACTER in miner_text and miner_text.count(REPLACEMENT_CHARACTER) != proven[:covered].count(
        REPLACEMENT_CHARACTER
    ):
        return "replacement-character"
    if miner_text != proven[:covered]:
        return "whitespace"
    return "held-back"


def reasoning_tokens(model: ServedModel, output_ids: Sequence[int] | None, answer: str) -> int:
    """Blocking: how many of an answer's tokens are its reasoning. With proven tokens, those up
    to the one that closes the `<think>` block (all of them when the answer never closed it);
    without, the reasoning's own tokenisation. 0 for an answer that does not reason."""
    reasoning = "".join(
        event.text for event in parse_output(answer, call_id_prefix="r") if isinstance(event, ReasoningDelta)
    )
    if not reasoning:
        return 0
    if not output_ids:
        return len(model.tokenizer.encode(reasoning, add_special_tokens=False))
    end = answer.find(THINK_CLOSE)
    if end < 0:
        return len(output_ids)
    return len(_covering_prefix(model, list(output_ids), answer[: end + len(THINK_CLOSE)]))


def _covering_prefix(model: ServedModel, output_ids: list[int], text: str) -> tuple[int, ...]:
    """The shortest prefix of `output_ids` whose decoding starts with `text` (which the whole
    decodes to a prefix of): the tokens a buyer received part or all of. Binary search: a
    longer prefix decodes to a longer text."""
    low, high = 0, len(output_ids)
    while low < high:
        middle = (low + high) // 2
        if model.decode(output_ids[:middle]).startswith(text):
            high = middle
        else:
            low = middle + 1
    return tuple(output_ids[:low])


def usage_padding(output: dict[str, Any], *, prompt_tokens: int, committed_tokens: int) -> str | None:
    """How a miner's usage claim exceeds what its own commitment shows, or None. Billing never
    pays for the excess (`billing.billable_usage`); claiming it is still established
    misbehaviour, since the miner's engine counted those very tokens."""
    usage = output.get("usage") if isinstance(output, dict) else None
    if not isinstance(usage, dict):
        return None
    claimed_prompt, claimed_completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    excess = []
    if count_or_zero(claimed_completion) > committed_tokens:
        excess.append(f"{claimed_completion} completion tokens claimed, {committed_tokens} committed")
    if count_or_zero(claimed_prompt) > prompt_tokens:
        excess.append(f"{claimed_prompt} prompt tokens claimed, {prompt_tokens} sent")
    return "; ".join(excess) or None


def count_or_zero(value: Any) -> int:
    """A count a miner reported, as the gateway reads it: a non-negative int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
