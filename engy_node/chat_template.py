"""Render a conversation with a checkpoint's chat template, as transformers renders it.

The gateway renders every buyer conversation to size its hold and to check the miner's
commitment `prompt_ids`, and the miner renders the same conversation to serve it: both must
produce exactly the text `tokenizer.apply_chat_template(..., tokenize=False)` produces, or the
ids differ. transformers' renderer is a jinja2 environment plus a few steps on the inputs; this
module is that environment and those steps, so a process can render without importing
transformers (whose tokenizer stack imports torch: ~375 MiB resident for a gateway worker that
needs a template and a Rust tokenizer). `checkpoint_tokenizer` checks, once per checkpoint,
that this renderer and transformers agree on its template.

What transformers does, and so what this does:

* the environment: jinja2's immutable sandbox (templates come from model repositories, so they
  are untrusted code) with `trim_blocks` and `lstrip_blocks`, the loop controls extension
  (`{% break %}`, `{% continue %}`) and a `{% generation %}` tag whose body renders as it is;
  a `tojson` filter that is `json.dumps` with its arguments (`ensure_ascii=False`: jinja's own
  escapes HTML characters), and the globals `raise_exception`, `strftime_now`, `dict` and a
  `namespace` that refuses underscore-prefixed attributes;
* the template: one, or one of several by name: `tool_use` when tools are given and the
  checkpoint has one, else `default`;
* the inputs: an empty conversation is refused; each message drops its keys whose value is None
  (an OpenAI `content: null` beside `tool_calls`), and one that carries its reasoning under
  `reasoning_content`, `thinking` or `reasoning` gets it under the first two as well;
* the variables: `messages`, `tools`, `documents` (always None here), `add_generation_prompt`,
  and the tokenizer's named special tokens (`bos_token`, `eos_token`, …) as strings.

Inputs are JSON data (what a request carries): transformers also accepts dataclasses, pydantic
models and media objects, and turns them into dicts or placeholders; here any other type is
refused rather than rendered some other way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

Templates = str | Mapping[str, str] | None
"""A checkpoint's chat templates: one, several by name, or none."""

RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
"""What the renderer itself sets; a request's `chat_template_kwargs` may not name them."""

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""Names a message's reasoning comes under; templates read the first (gpt-oss's the second)."""


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: no template, an empty conversation, or inputs that
    are not JSON data. (A template's own `raise_exception` raises `jinja2.TemplateError`.)"""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks; for
    inference its body renders unchanged. Without the tag, a template using it would not parse."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type itself (whose
    attributes would let a template reach past the sandbox)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's `namespace`, refusing underscore-prefixed attributes (a way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # jinja's own signature trick, so that `namespace(self=...)` still works.
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace (got {name!r})"
            )


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment


_ENVIRONMENT = _environment()
_GLOBALS = dict(_ENVIRONMENT.globals)
"""What every template sees besides its variables (templates are compiled without globals of
their own)."""


class ChatTemplates:
    """A checkpoint's chat templates, each compiled when first used (as transformers does: a
    template that does not parse fails the requests that use it, not the others)."""

    def __init__(self, templates: Templates) -> None:
        self.named = isinstance(templates, Mapping)
        self._sources = (
            dict(templates) if isinstance(templates, Mapping) else {} if templates is None else {"default": templates}
        )
        self._compiled: dict[str, jinja2.Template] = {}

    def select(self, *, tools: Sequence[Any] | None) -> jinja2.Template:
        """The template transformers would use: the only one whatever the tools; of named ones,
        `tool_use` when tools are given and there is one, else `default`."""
        if self.named and tools is not None and "tool_use" in self._sources:
            return self._template("tool_use")
        if "default" in self._sources:
            return self._template("default")
        if not self._sources:
            raise ChatTemplateError(
                "this checkpoint has no chat template; use an instruction-tuned checkpoint, "
                "whose tokenizer_config.json or chat_template.jinja carries one"
            )
        raise ChatTemplateError(
            f"this checkpoint has several chat templates ({', '.join(sorted(self._sources))}) "
            "and none named default; name one default in its tokenizer_config.json"
        )

    def _template(self, name: str) -> jinja2.Template:
        # Two threads may both compile a template the first time; either result serves.
        compiled = self._compiled.get(name)
        if compiled is None:
            compiled = self._compiled[name] = _ENVIRONMENT.from_string(self._sources[name])
        return compiled

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation's text; `variables` are the tokenizer's named special tokens (and
        anything else the caller passes the template)."""
        template = self.select(tools=tools)
        if not messages:
            raise ChatTemplateError("cannot render an empty conversation; send at least one message")
        if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
            raise ChatTemplateError("each tool must be a JSON object (a function's JSON schema)")
        chat = [
            _with_reasoning_aliases(
                _plain({key: value for key, value in _message(message).items() if value is not None})
            )
            for message in messages
        ]
        # The globals go in with the variables, as `template.render` would put them, but from a
        # dict flattened once: `render` copies them out of their ChainMap on every call, which
        # cost about as much as rendering a short conversation itself.
        names = {
            **_GLOBALS,
            "messages": chat,
            "tools": _plain(list(tools)) if tools is not None else None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **_plain(dict(variables or {})),
        }
        return str(template.make_module(names, shared=True))


def _message(message: Any) -> Mapping[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"a chat message must be a JSON object, got {message!r}")
    return message


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """A fresh copy of JSON data, with subclasses of its types (enums, say) made their base type:
    what the template sees is plain data, and the caller's objects stay untouched."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value) is dict:  # before the `Mapping` ABC, whose `isinstance` costs several times this
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    raise ChatTemplateError(f"chat template inputs must be JSON data; got a {type(value).__name__}")
