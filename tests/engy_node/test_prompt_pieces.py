"""`PieceEncoder`: piecewise, cached tokenisation must give exactly the tokenizer's ids.

Checked on the embedded model's real tokenizer with texts mixing added tokens, whitespace and
unicode, each encoded twice (the second time from the cache), and on small tokenizers built
here whose added tokens or pre-tokenizer make piecewise encoding differ: those are used whole.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from engy_node.models import SMOLLM2_135M
from engy_node.prompt_pieces import PieceEncoder
from engy_node.served_model import load_served_model

ADDED = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<reponame>"]
piece = st.one_of(
    st.text(max_size=60),
    st.sampled_from(ADDED),
    st.sampled_from([" ", "\n", "\n\n", "  x", "é", "🙂", "system\n"]),
    st.sampled_from(["You are a helpful assistant. " * 3, "def f(x):\n    return x  # 東京\n"]),
)
text = st.lists(piece, max_size=12).map("".join)


@pytest.fixture(scope="module")
def backend(checkpoint):
    return load_served_model(SMOLLM2_135M, checkpoint).tokenizer.backend_tokenizer


def whole(backend, value: str) -> list[int]:
    return backend.encode(value, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def encoder(backend) -> PieceEncoder:
    return PieceEncoder(backend)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(text, min_size=1, max_size=4))
def test_piecewise_ids_equal_the_tokenizers_first_time_and_from_the_cache(backend, encoder, values):
    """One encoder across examples: later examples also meet pieces cached by earlier ones."""
    assert encoder.piecewise
    for value in values + values:
        assert encoder.encode(value) == whole(backend, value)


def test_the_cache_keeps_to_its_character_budget_dropping_the_least_recently_used(backend):
    encoder = PieceEncoder(backend, max_cached_chars=400)
    pieces = [f"piece number {index} of a long conversation turn" for index in range(30)]
    for value in pieces:
        assert encoder.encode(f"<|im_start|>{value}<|im_end|>") == whole(backend, f"<|im_start|>{value}<|im_end|>")
    assert encoder._cached_chars <= 400
    assert pieces[-1] in encoder._cache and pieces[0] not in encoder._cache
    assert encoder.encode(pieces[0]) == whole(backend, pieces[0])


def char_tokenizer(pre_tokenizer=None, added: AddedToken | None = None) -> Tokenizer:
    alphabet = sorted(set("abcdefghijklmnopqrstuvwxyz ▁\n\t"))
    tokenizer = Tokenizer(
        models.BPE(vocab={"[UNK]": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}, merges=[], unk_token="[UNK]")
    )
    if pre_tokenizer is not None:
        tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.add_special_tokens([added or AddedToken("<x>", special=True, normalized=False)])
    return tokenizer


def test_a_plain_tokenizer_is_encoded_piecewise():
    tokenizer = char_tokenizer()
    encoder = PieceEncoder(tokenizer)
    assert encoder.piecewise
    value = "a long enough piece of text<x>another long enough piece"
    assert encoder.encode(value) == whole(tokenizer, value)


@pytest.mark.parametrize(
    "added",
    [
        AddedToken("<x>", special=True, lstrip=True, normalized=False),
        AddedToken("<x>", special=True, rstrip=True, normalized=False),
        AddedToken("<x>", special=True, normalized=True),
    ],
)
def test_an_added_token_that_touches_its_neighbours_means_whole_encoding(added):
    tokenizer = char_tokenizer(added=added)
    encoder = PieceEncoder(tokenizer)
    assert not encoder.piecewise
    value = "a long enough piece of text <x> another long enough piece"
    assert encoder.encode(value) == whole(tokenizer, value)


def test_a_prefix_space_only_at_the_start_is_caught_by_the_probes():
    tokenizer = char_tokenizer(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"))
    assert not PieceEncoder(tokenizer).piecewise


def test_a_tokenizer_set_to_truncate_or_pad_still_gives_the_whole_prompt():
    """A tokenizer.json may carry truncation and padding; a prompt is never cut or padded, so
    the encoder switches both off on the tokenizer it is given (it keeps no copy)."""
    tokenizer = char_tokenizer()
    value = "a long enough piece of text<x>another long enough piece"
    full = whole(tokenizer, value)
    tokenizer.enable_truncation(8)
    tokenizer.enable_padding(length=200)
    encoder = PieceEncoder(tokenizer)
    assert encoder.piecewise
    assert encoder.encode(value) == full
    assert (tokenizer.truncation, tokenizer.padding) == (None, None)


def test_a_tokenizer_that_splits_special_tokens_as_text_is_used_whole():
    tokenizer = char_tokenizer()
    tokenizer.encode_special_tokens = True
    encoder = PieceEncoder(tokenizer)
    assert not encoder.piecewise
    value = "some text<x>more text"
    assert encoder.encode(value) == whole(tokenizer, value)
