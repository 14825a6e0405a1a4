"""Tokenise rendered chat prompts piece by piece, remembering the pieces.

A chat template's output is text between added tokens (`<|im_start|>`, `<|im_end|>`, tool tags).
A Hugging Face tokenizer splits its input at added tokens before anything else and tokenises
each piece on its own, so the ids of the whole are the ids of the pieces in order, with each
added token's id between them. That holds unless an added token strips its neighbours'
whitespace, matches whole words only or is matched after normalisation, or the pre-tokenizer
treats the first piece differently (a prefix space only at the start); `PieceEncoder.check`
compares both ways on probe texts when it is built, and a tokenizer that differs is used whole.

Why: the gateway and the miner tokenise every request's whole conversation, and a conversation
comes back on every turn grown by one turn; its system prompt, tools and earlier messages are
unchanged pieces. Remembering pieces makes a turn cost its new text rather than its history,
and a short request cost its own words rather than the template's boilerplate too. The cache
is bounded by the characters it holds; the least recently used pieces go first.
"""

from __future__ import annotations

import array
import collections
import re
import threading
from typing import Any

MAX_CACHED_CHARS = 4_000_000
"""About a million tokens of conversation: ~4 MB of ids plus the text that keys them."""
GIL_FREE_MIN_CHARS = 8192
"""Text at least this long is tokenised through `encode_batch`, which lets go of the GIL while
the Rust tokenizer works; `encode` holds it throughout (measured: 0.43 s for 1 MB of text, during
which no other thread, the event loop included, ran). Shorter text takes `encode`, whose
per-call cost is a little lower and whose hold is a few milliseconds at most."""

PROBES = (
    "plain text",
    " leading space, then a token{T}after it",
    "{T}\nstarts with a token{T}{T}two in a row{T} ",
    "line one\n\n{T}  spaced   out  {T}ünïcode ✓ 東京{T}\ttab",
    "{T}word{T}word{T}",
)


class PieceEncoder:
    """`encode(text)`: the same ids as the tokenizer's `encode(text, add_special_tokens=False)`
    with truncation and padding off, which it switches off on `backend`."""

    def __init__(self, backend: Any, *, max_cached_chars: int = MAX_CACHED_CHARS) -> None:
        # The tokenizer itself, not a copy (a large vocabulary's is tens of MiB), with truncation
        # and padding switched off: a prompt is never truncated or padded (its length is checked).
        self.backend = backend
        self.backend.no_truncation()
        self.backend.no_padding()
        self.max_cached_chars = max_cached_chars
        self._cache: collections.OrderedDict[str, array.array] = collections.OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()
        added = self.backend.get_added_tokens_decoder().values()
        self._added_ids = {token.content: self.backend.token_to_id(token.content) for token in added}
        # With encode_special_tokens the tokenizer tokenises added tokens' text like any other.
        splittable = (
            added
            and not self.backend.encode_special_tokens
            and all(not (token.lstrip or token.rstrip or token.single_word or token.normalized) for token in added)
        )
        contents = sorted(self._added_ids, key=len, reverse=True)
        # Longest first: at one position the regex takes the first alternative that matches,
        # which then is the longest, as the tokenizer's own leftmost-longest match does.
        self._splitter = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if splittable else None
        if self._splitter is not None and not self.check(contents):
            self._splitter = None

    @property
    def piecewise(self) -> bool:
        return self._splitter is not None

    def check(self, added: list[str]) -> bool:
        """Whether piecewise encoding gives the tokenizer's ids on the probe texts."""
        for token in added:
            for probe in PROBES:
                text = probe.replace("{T}", token)
                if self._encode_pieces(text, remember=False) != self._whole(text):
                    return False
        return True

    def encode(self, text: str) -> list[int]:
        if self._splitter is None:
            return self._whole(text)
        return self._encode_pieces(text, remember=True)

    def _whole(self, text: str) -> list[int]:
        if len(text) >= GIL_FREE_MIN_CHARS:
            return self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        return self.backend.encode(text, add_special_tokens=False).ids

    def _encode_pieces(self, text: str, *, remember: bool) -> list[int]:
        # Called only while piecewise (check runs on a splitter just built, encode checks first).
        assert self._splitter is not None
        ids: list[int] = []
        for index, piece in enumerate(self._splitter.split(text)):
            if not piece:
                continue
            if index % 2:
                ids.append(self._added_ids[piece])
            elif not remember:
                ids += self._whole(piece)
            else:
                ids += self._cached(piece)
        return ids

    def _cached(self, piece: str) -> array.array:
        with self._lock:
            found = self._cache.get(piece)
            if found is not None:
                self._cache.move_to_end(piece)
                return found
        encoded = array.array("I", self._whole(piece))
        if len(piece) > self.max_cached_chars // 4:
            return encoded
        with self._lock:
            if piece not in self._cache:
                self._cache[piece] = encoded
                self._cached_chars += len(piece)
                while self._cached_chars > self.max_cached_chars:
                    evicted, _ = self._cache.popitem(last=False)
                    self._cached_chars -= len(evicted)
        return encoded
