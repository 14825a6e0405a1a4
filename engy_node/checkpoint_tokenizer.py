"""A checkpoint's tokenizer exactly as transformers builds it, used without importing transformers.

Why. Every role tokenises conversations with the checkpoint's tokenizer and chat template, and
the gateway checks a miner's `prompt_ids` against its own: both must get the ids
`AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(..., tokenize=True)` gives.
Importing transformers' tokenizer stack imports torch, ~375 MiB resident in every gateway
worker, which needs only a Rust tokenizer and a jinja template.

Why not read tokenizer.json directly. transformers does not always use it as it is: a class
with its own constructor (Qwen2Tokenizer, among others) rebuilds the tokenizer from the file's
vocabulary with its own normaliser and pre-tokenizer, named special tokens and the config's
added tokens are added or re-flagged, a post-processor may be rebuilt, Mistral regexes patched.
Reproducing all of that would drift with every transformers release. Instead, a short-lived
child process (`python -m engy_node.checkpoint_tokenizer CHECKPOINT`) loads the tokenizer with
transformers once and writes what it built: the Rust tokenizer serialised, the named special
tokens, the chat templates, the EOS id, whether decoding cleans up spaces and whether special
tokens' text is split. The node loads that with the `tokenizers` library, and renders with
`chat_template`, which reproduces transformers' jinja environment. The child also renders and
tokenises a set of probe conversations both ways and refuses the checkpoint if any differ, so
a template feature the renderer lacks shows at load, not as a mismatched commitment.

The snapshot is cached under `tokenizers/` in the user cache directory (`cache_dir` moves it),
keyed by a hash of the checkpoint's files other than its weights and of the versions of
transformers, tokenizers, jinja2 and engy-node: the first load of a checkpoint costs the child
(~7 s and ~365 MiB while it runs, on a 2-core VM), later loads read the file. Several processes missing it at once each take
it and write it atomically; one that cannot write (a read-only cache) uses it all the same.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engy_node.chat_template import ChatTemplates
from engy_node.errors import ModelError
from engy_node.prompt_pieces import GIL_FREE_MIN_CHARS

log = logging.getLogger("engy.tokenizer")

SNAPSHOT_FORMAT = 1
"""Bumped when the snapshot's fields or their meaning change: older files are then retaken."""
SNAPSHOT_TIMEOUT_S = 300.0
"""The child imports torch and transformers and reads the tokenizer: seconds, more on a cold disk."""
KEYED_PACKAGES = ("transformers", "tokenizers", "jinja2", "engy-node")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt", ".npz", ".npy")
"""Files transformers' tokenizer loading never reads, left out of the snapshot's key."""
CONTENT_HASHED_MAX_BYTES = 64 * 2**20
"""Larger non-weight files (no tokenizer file is near this) count by name, size and mtime only."""
SNAPSHOT_FIELDS = (
    "backend",
    "special_tokens",
    "chat_template",
    "eos_token_id",
    "unk_token_id",
    "split_special_tokens",
    "decode_cleans_up",
)

PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
]
PROBE_CONVERSATIONS: tuple[tuple[list[dict[str, Any]], list[dict[str, Any]] | None], ...] = (
    ([{"role": "user", "content": "Hello!"}], None),
    (
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another, in 東京 style ✓"},
        ],
        None,
    ),
    ([{"role": "user", "content": ""}], None),
    ([{"role": "user", "content": "What is the weather in Paris?"}], PROBE_TOOLS),
    (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "I should call the tool.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        ],
        PROBE_TOOLS,
    ),
)
"""Conversations rendered both ways when a snapshot is taken (each with and without the
generation prompt): plain, multi-turn, empty content, tools offered, and a tool call answered
with reasoning, None content and a tool message."""
PROBE_TEXTS = (
    "Hello , world . Isn 't it ? I 'm sure they 've said it 's so !",
    "  spaced\tout\n\nlines  ",
    "ünïcode ✓ 東京 e\u0301 🙂",
    "<|im_start|>user\nhi<|im_end|>",
    "",
)
"""Texts encoded and decoded both ways: the clean-up's patterns, whitespace, unicode (a
combining accent, which a normaliser composes), and the usual added tokens' text."""
OVERRIDE_CHECKED = (
    "__call__",
    "encode",
    "_encode_plus",
    "decode",
    "_decode",
    "clean_up_tokenization",
    "convert_tokens_to_ids",
    "apply_chat_template",
    "get_chat_template",
)
"""transformers methods whose base behaviour a snapshot reproduces: a tokenizer class that
overrides one is refused."""


def default_cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("engy")) / "tokenizers"


class CheckpointTokenizer:
    """The parts of a transformers tokenizer the node uses, with the same results: `encode`,
    `decode`, `convert_tokens_to_ids` and `apply_chat_template` as transformers' (single
    inputs only), `render` for the template's text alone, and the Rust tokenizer itself as
    `backend_tokenizer` (truncation and padding off: a prompt is never truncated or padded)."""

    def __init__(self, snapshot: Mapping[str, Any]) -> None:
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_str(snapshot["backend"])
        self.backend_tokenizer.no_truncation()
        self.backend_tokenizer.no_padding()
        self.backend_tokenizer.encode_special_tokens = bool(snapshot["split_special_tokens"])
        self.special_tokens_map: dict[str, str] = dict(snapshot["special_tokens"])
        self.eos_token_id: int | None = snapshot["eos_token_id"]
        self.unk_token_id: int | None = snapshot["unk_token_id"]
        self.decode_cleans_up: bool = bool(snapshot["decode_cleans_up"])
        self.templates = ChatTemplates(snapshot["chat_template"])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= GIL_FREE_MIN_CHARS:
            return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.decode_cleans_up else text

    def convert_tokens_to_ids(self, token: str) -> int | None:
        found = self.backend_tokenizer.token_to_id(token)
        return self.unk_token_id if found is None else found

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation's text; `template_kwargs` go to the template as variables, as
        transformers passes `apply_chat_template`'s extra keyword arguments (`enable_thinking`)."""
        variables = {**self.special_tokens_map, **(template_kwargs or {})}
        return self.templates.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, variables=variables
        )

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
    ) -> list[int] | str:
        """transformers' `apply_chat_template` for one conversation: the rendered text, or its
        ids (special tokens are the template's to write, so none are added)."""
        text = self.render(conversation, tools=tools, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces a WordPiece decode leaves before punctuation."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text


def load_tokenizer(checkpoint: Path, *, cache_dir: Path | None = None) -> CheckpointTokenizer:
    """Blocking: the checkpoint's tokenizer from its cached snapshot, taken first if missing."""
    cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
    path = cache_dir / f"{snapshot_key(checkpoint)}.json"
    snapshot = read_snapshot(path)
    if snapshot is None:
        snapshot = snapshot_in_child(checkpoint)
        _write_atomically(path, snapshot)
    tokenizer = CheckpointTokenizer(snapshot)
    del snapshot
    return_freed_heap()
    return tokenizer


def return_freed_heap() -> None:
    """Hand heap that was freed back to the system (glibc's `malloc_trim`; elsewhere nothing).
    Parsing a tokenizer's JSON frees most of what it allocates, but glibc keeps it: measured
    with a 151,643-token BPE (Qwen's vocabulary size), +115 MiB resident after the parse,
    +47 MiB once trimmed, which for a gateway worker is the difference between about 100 MiB
    and over 150 MiB."""
    import ctypes

    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        return
    trim(0)


def snapshot_key(checkpoint: Path) -> str:
    """A hash of what a snapshot of this checkpoint depends on: its files other than weights
    (names and contents) and the versions of the libraries that build and check it."""
    digest = hashlib.sha256(f"engy tokenizer snapshot {SNAPSHOT_FORMAT}\n".encode())
    for package in KEYED_PACKAGES:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{package} {version}\n".encode())
    for path in _keyed_files(checkpoint):
        stat = path.stat()
        digest.update(f"{path.relative_to(checkpoint).as_posix()} {stat.st_size}\n".encode())
        if stat.st_size > CONTENT_HASHED_MAX_BYTES:
            digest.update(f"mtime {stat.st_mtime_ns}\n".encode())
            continue
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(2**20), b""):
                digest.update(block)
    return digest.hexdigest()


def _keyed_files(checkpoint: Path) -> list[Path]:
    if not checkpoint.is_dir():
        raise ModelError(f"{checkpoint} is not a directory; point --checkpoint at a model directory")
    files = [path for path in checkpoint.iterdir() if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES)]
    templates = checkpoint / "additional_chat_templates"
    if templates.is_dir():
        files += [path for path in templates.glob("*.jinja") if path.is_file()]
    return sorted(files)


def read_snapshot(path: Path) -> dict[str, Any] | None:
    """The snapshot at `path`, or None when there is none or it is unreadable or of another format."""
    try:
        snapshot = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(snapshot, dict) or snapshot.get("format") != SNAPSHOT_FORMAT:
        return None
    if not all(field in snapshot for field in SNAPSHOT_FIELDS) or not isinstance(snapshot["backend"], str):
        return None
    return snapshot


def _write_atomically(path: Path, snapshot: Mapping[str, Any]) -> None:
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, prefix=".snapshot-", suffix=".tmp", delete=False, encoding="utf-8"
        ) as handle:
            temporary = handle.name
            json.dump(snapshot, handle, ensure_ascii=False)
        os.replace(temporary, path)
    except OSError as error:
        # The tokenizer is loaded all the same; the next start takes the snapshot again.
        log.warning(
            "could not cache the tokenizer snapshot in %s (%s); it is retaken at every start", path.parent, error
        )
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def snapshot_in_child(checkpoint: Path) -> dict[str, Any]:
    """Blocking: take the snapshot in a child process, so that this one never imports torch."""
    command = [sys.executable, "-m", "engy_node.checkpoint_tokenizer", str(checkpoint)]
    try:
        result = subprocess.run(command, capture_output=True, timeout=SNAPSHOT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ModelError(
            f"reading the tokenizer of {checkpoint} took over {SNAPSHOT_TIMEOUT_S:.0f} s; "
            "check the disk, then start again"
        ) from None
    if result.returncode != 0:
        reason = result.stderr.decode(errors="replace").strip().splitlines()[-1:] or [
            f"exit status {result.returncode}"
        ]
        raise ModelError(f"could not read the tokenizer of {checkpoint}: {reason[0]}")
    try:
        snapshot = json.loads(result.stdout)
    except ValueError:
        snapshot = None
    if not isinstance(snapshot, dict) or snapshot.get("format") != SNAPSHOT_FORMAT:
        raise ModelError(f"reading the tokenizer of {checkpoint} gave no snapshot; is this engy_node installed whole?")
    return snapshot


def take_snapshot(checkpoint: Path) -> dict[str, Any]:
    """In the child: load the tokenizer with transformers, check that a snapshot reproduces it
    on the probe conversations, and return the snapshot."""
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    except (OSError, ValueError) as error:
        raise ModelError(
            f"transformers cannot load a tokenizer from {checkpoint} ({error}); point --checkpoint "
            "at a directory with tokenizer.json and tokenizer_config.json"
        ) from None
    if not isinstance(tokenizer, TokenizersBackend):
        raise ModelError(
            f"{checkpoint}'s tokenizer ({type(tokenizer).__name__}) has no Rust backend; "
            "use a checkpoint that ships tokenizer.json"
        )
    # A snapshot reproduces the base classes' encoding, decoding and chat template; a class
    # that overrides any of them would tokenise or decode some other way.
    overridden = [
        name for name in OVERRIDE_CHECKED if getattr(type(tokenizer), name) is not getattr(TokenizersBackend, name)
    ]
    if overridden:
        raise ModelError(
            f"{checkpoint}'s tokenizer class {type(tokenizer).__name__} overrides {', '.join(overridden)}, "
            "which the node cannot reproduce without transformers; serve a checkpoint with another tokenizer"
        )
    backend = tokenizer.backend_tokenizer
    snapshot = {
        "format": SNAPSHOT_FORMAT,
        "transformers": importlib.metadata.version("transformers"),
        "tokenizer_class": type(tokenizer).__name__,
        "backend": backend.to_str(),
        "special_tokens": dict(tokenizer.special_tokens_map),
        "chat_template": tokenizer.chat_template,
        "eos_token_id": tokenizer.eos_token_id,
        "unk_token_id": tokenizer.unk_token_id,
        "split_special_tokens": bool(tokenizer.split_special_tokens),
        # As transformers' `_decode`: its clean-up is skipped for BPE, which it would corrupt.
        "decode_cleans_up": bool(tokenizer.clean_up_tokenization_spaces)
        and not (
            type(backend.model).__name__ == "BPE"
            and not getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        ),
    }
    differences = compare(tokenizer, CheckpointTokenizer(snapshot))
    if differences:
        raise ModelError(
            f"the node's tokenizer for {checkpoint} differs from transformers' ({differences[0]}); "
            "serve it with an engy-node release that supports its chat template"
        )
    return snapshot


def compare(reference: Any, tokenizer: CheckpointTokenizer) -> list[str]:
    """Where `tokenizer` differs from the transformers tokenizer `reference` on the probe
    conversations (rendered text and ids, with and without the generation prompt; refusing
    agrees with refusing, however worded) and on encoding and decoding probe text."""
    differences = []
    for index, (messages, tools) in enumerate(PROBE_CONVERSATIONS):
        for add_generation_prompt in (True, False):
            for tokenize in (False, True):
                terms: dict[str, Any] = {
                    "tools": tools,
                    "add_generation_prompt": add_generation_prompt,
                    "tokenize": tokenize,
                }
                theirs = outcome(functools.partial(reference.apply_chat_template, messages, **terms))
                ours = outcome(functools.partial(tokenizer.apply_chat_template, messages, **terms))
                if theirs != ours and not theirs[0] == ours[0] == "error":
                    differences.append(
                        f"probe conversation {index}, add_generation_prompt={add_generation_prompt}, "
                        f"tokenize={tokenize}: {ours!r:.200} against {theirs!r:.200}"
                    )
    for text in PROBE_TEXTS:
        for add_special_tokens in (False, True):
            ids = reference.encode(text, add_special_tokens=add_special_tokens)
            if tokenizer.encode(text, add_special_tokens=add_special_tokens) != ids:
                differences.append(f"encoding {text!r} (add_special_tokens={add_special_tokens})")
            for skip in (False, True):
                if tokenizer.decode(ids, skip_special_tokens=skip) != reference.decode(ids, skip_special_tokens=skip):
                    differences.append(f"decoding {text!r} (skip_special_tokens={skip})")
    return differences


def outcome(call: Any) -> tuple:
    """`("ok", text or ids)` of a chat template call, or `("error", type name, message)`."""
    try:
        result = call()
    except Exception as error:  # broad on purpose: what matters is that both fail alike
        return ("error", type(error).__name__, str(error))
    return (
        "ok",
        result if isinstance(result, str) else list(result["input_ids"] if isinstance(result, Mapping) else result),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m engy_node.checkpoint_tokenizer CHECKPOINT`: the snapshot as JSON on stdout."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m engy_node.checkpoint_tokenizer CHECKPOINT_DIR", file=sys.stderr)
        return 2
    try:
        # Whatever the libraries print goes to stderr: stdout carries the snapshot alone.
        with contextlib.redirect_stdout(sys.stderr):
            snapshot = take_snapshot(Path(args[0]))
    except ModelError as error:
        print(error, file=sys.stderr)
        return 2
    sys.stdout.buffer.write(json.dumps(snapshot, ensure_ascii=False).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
