"""A checkpoint's chat template, rendered in the environment `transformers` renders it in.

Owns finding the template (`chat_template.jinja`, `additional_chat_templates/`, or
`tokenizer_config.json`'s `chat_template`, plain or named), the special tokens a template
sees, and the jinja2 environment: sandboxed (ImmutableSandboxedEnvironment), `trim_blocks`
and `lstrip_blocks`, the `loopcontrols` extension, a no-op `{% generation %}` block, the
globals `raise_exception`, `strftime_now`, `dict` and a `namespace` that refuses
underscore names, and a `tojson` that does not HTML-escape and takes `indent`. Messages
are prepared as `apply_chat_template` prepares them (keys whose value is null dropped,
reasoning aliased as `reasoning_content` and `thinking`), so a template renders
byte-for-byte what `transformers` renders. Must not tokenize or touch request validation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from pdflash.errors import CheckpointError

# The named special tokens `transformers` hands every template (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # names a message's reasoning comes under
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})  # render's own


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`, or a rendering error)."""


@attrs.frozen(kw_only=True)
class ChatTemplate:
    """One or more named jinja templates plus the special tokens they see."""

    templates: Mapping[str, str]  # name -> source; "default" is used unless tools pick "tool_use"
    special_tokens: Mapping[str, str] = attrs.field(factory=dict)  # e.g. {"eos_token": "<|im_end|>"}
    _compiled: dict[str, jinja2.Template] = attrs.field(factory=dict, init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if not self.templates:
            raise ValueError("a ChatTemplate needs at least one template")
        for name, source in self.templates.items():
            try:
                self._compiled[name] = _ENVIRONMENT.from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise CheckpointError(f"chat template {name!r} does not compile: {exc} (line {exc.lineno})") from exc

    @classmethod
    def from_source(cls, source: str, special_tokens: Mapping[str, str] | None = None) -> ChatTemplate:
        return cls(templates={"default": source}, special_tokens=dict(special_tokens or {}))

    @classmethod
    def from_checkpoint(cls, directory: Path) -> ChatTemplate | None:
        """The template a checkpoint directory ships, or None if it has none."""
        config = _read_json(directory / "tokenizer_config.json")
        templates = _templates(directory, config)
        if not templates:
            return None
        return cls(templates=templates, special_tokens=_special_tokens(directory, config))

    @property
    def source(self) -> str:
        """The default template's text (the one family detection reads)."""
        return self.templates.get("default") or next(iter(self.templates.values()))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """The conversation as text, as `tokenizer.apply_chat_template(..., tokenize=False)` returns it.

        `variables` are extra template variables (a request's `chat_template_kwargs`); they
        override special tokens of the same name, as in `transformers`.
        """
        if not messages:
            raise ChatTemplateError("cannot render an empty conversation: give at least one message")
        name = "tool_use" if tools is not None and "tool_use" in self._compiled else self._default_name()
        try:
            return self._compiled[name].render(
                messages=prepare_messages(messages),
                tools=None if tools is None else [dict(t) for t in tools],
                documents=None if documents is None else [dict(d) for d in documents],
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **variables},
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from None
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as exc:  # the template's own code
            raise ChatTemplateError(f"the template failed on this input: {type(exc).__name__}: {exc}") from None

    def _default_name(self) -> str:
        if "default" in self._compiled:
            return "default"
        if len(self._compiled) == 1:
            return next(iter(self._compiled))
        raise ChatTemplateError(f"this model has several chat templates and no default: {sorted(self._compiled)}")


def prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as `apply_chat_template` hands them to a template.

    Keys whose value is null are dropped (templates test for a missing key, not for None),
    and a message's reasoning, under any of its names, is also given as `reasoning_content`
    (what most templates read) and `thinking` (what gpt-oss templates read).
    """
    prepared = []
    for message in messages:
        m = {key: value for key, value in message.items() if value is not None}
        reasoning = next((m[key] for key in REASONING_FIELDS if key in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        prepared.append(m)
    return prepared


# -- the environment ---------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    """JSON without jinja's HTML escaping (templates embed tool schemas verbatim)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeDict:
    """The template's `dict(...)`: builds a plain dict, exposes nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


class _SafeNamespace(jinja2.utils.Namespace):
    """jinja's `namespace` that refuses underscore-prefixed names (no way to reach internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own signature trick: `self` may be a keyword
        self, values = args[0], dict(*args[1:], **kwargs)
        for name in values:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the underscore name {name!r}")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` renders its body (it only marks assistant text for training)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_SafeDict(), namespace=_SafeNamespace
    )
    return env


_ENVIRONMENT = _environment()


# -- reading a checkpoint ----------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Template files win over `tokenizer_config.json` entries, as in `transformers`."""
    files: dict[str, str] = {}
    if (directory / "chat_template.jinja").is_file():
        files["default"] = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    extra = directory / "additional_chat_templates"
    if extra.is_dir():
        files |= {p.stem: p.read_text(encoding="utf-8") for p in sorted(extra.glob("*.jinja"))}
    if files:
        return files
    entry = config.get("chat_template")
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in entry if isinstance(t, dict) and "name" in t and "template" in t}
    return {}


def _special_tokens(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens as strings (an AddedToken dict gives its `content`)."""
    legacy = _read_json(directory / "special_tokens_map.json")
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name, legacy.get(name))
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens
