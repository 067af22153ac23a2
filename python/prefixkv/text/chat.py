"""Chat templates: messages and tool schemas to prompt text, with where each span came from.

A chat template has a `digest()` (the cache context includes it: the same conversation rendered
by two templates is two prompts), and `render_with_segments` says which character span of the
rendered text came from which message or tool, and which from the template itself. The analyzer
maps a divergence token back through the tokenizer's character offsets to one of these segments
to say "the prompts part ways inside message 0 (system)" rather than "at token 37" (the
attribution itself is `prefixkv.text.segments`).

* `SimpleChatTemplate`: the built-in template, written for `ByteTokenizer`'s special tokens.
* `JinjaChatTemplate`: a Hugging Face style template, run in jinja2's immutable sandbox, bounded
  in steps, size and time (`prefixkv.text.sandbox`; every failure is a `ChatTemplateError`),
  with the variables Hugging Face templates expect (`messages`, `tools`,
  `add_generation_prompt`, the special tokens, `raise_exception`, `strftime_now`). Its segments
  are found by rendering once more with each message's content wrapped in private-use sentinel
  characters; a template that transforms content (strip, upper...) breaks the sentinels, and
  then each content string is searched for in the plain render instead; when even that fails
  the segment is "unknown". ``jinja2`` is an optional dependency (`prefixkv[hf]`).
* `ChatTemplateSet`: a checkpoint's named templates, chosen per request as transformers does.
  `prefixkv.models.checkpoint.find_chat_template` finds the template(s) a checkpoint ships.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixkv.errors import ChatTemplateError, InvalidInputError, MissingDependencyError
from prefixkv.text.segments import Segment, Segments, attribute, message_text, segment_at

if TYPE_CHECKING:
    from prefixkv.text.sandbox import RenderLimits

__all__ = [
    "MAX_NESTING",
    "ChatTemplate",
    "ChatTemplateSet",
    "JinjaChatTemplate",
    "Segment",
    "SimpleChatTemplate",
    "checked_input",
    "load_chat_template",
    "message_text",
    "segment_at",
]


def _missing_jinja() -> MissingDependencyError:
    return MissingDependencyError(
        "a Jinja chat template needs the 'jinja2' package: pip install 'prefixkv[hf]'"
    )


#: The deepest nesting of lists and objects a message or tool may hold (a message or tool is
#: level 1). Real tool schemas nest a few levels; Python's recursive encoders (`json.dumps`,
#: `tojson`, a template's own filters) fail near 1,000, and exactly where depends on how deep
#: the caller's stack already is, so the bound is checked here, without recursing.
MAX_NESTING = 100


def checked_input(
    messages: Any, tools: Any
) -> tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None]:
    """`messages` and `tools` as given, or `InvalidInputError` naming the field: each must be a
    list (or tuple) of mappings, nested at most `MAX_NESTING` deep. Nothing is copied (a
    conversation may hold hundreds of thousands of messages)."""
    out: dict[str, Sequence[Mapping[str, Any]]] = {}
    for field, items in (("messages", messages), ("tools", tools)):
        if items is None and field == "tools":
            continue
        if isinstance(items, str | bytes | Mapping) or not isinstance(items, Sequence):
            raise InvalidInputError(
                f"{field} must be a list of mappings, got {type(items).__name__}"
            )
        if _all_shallow_mappings(items):
            out[field] = items
            continue
        for i, item in enumerate(items):  # something is wrong: find the first item, name it
            if not isinstance(item, Mapping):
                raise InvalidInputError(
                    f"{field}[{i}] must be a mapping, got {type(item).__name__}"
                )
            _check_nesting(item, f"{field}[{i}]")
        out[field] = items
    return out["messages"], out.get("tools")


_SCALARS = frozenset({str, int, float, bool, type(None)})


def _all_shallow_mappings(items: Sequence[Any]) -> bool:
    """True when every item is a mapping nested at most `MAX_NESTING` deep: the check below
    for all items at once, a level at a time, with no work per scalar beyond its type (a
    conversation of 600,000 short messages is checked in a fraction of a second)."""
    level = list(items)
    if not all(type(item) is dict or isinstance(item, Mapping) for item in level):
        return False
    depth = 1
    while level:
        if depth > MAX_NESTING:
            return False
        level = [
            child
            for item in level
            for child in (
                item.values() if type(item) is dict or isinstance(item, Mapping) else item
            )
            if type(child) not in _SCALARS and isinstance(child, Mapping | list | tuple)
        ]
        depth += 1
    return True


def _check_nesting(value: Mapping[str, Any], where: str) -> None:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > MAX_NESTING:
            raise InvalidInputError(f"{where} is nested deeper than {MAX_NESTING} levels")
        stack.extend((child, depth + 1) for child in children)


class ChatTemplate:
    """Turns OpenAI-style messages (and optional tool schemas) into prompt text.

    Every template refuses input of the wrong shape, or nested deeper than `MAX_NESTING`, with
    an `InvalidInputError` naming the field (`checked_input`).
    """

    name: str = "template"
    version: str = "0"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        raise NotImplementedError

    def render_segments(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Sequence[Segment]:
        return self.render_with_segments(messages, add_generation_prompt, tools)[1]

    def render_with_segments(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[str, Sequence[Segment]]:
        """The rendered text and segments tiling it; default: one "unknown" segment."""
        text = self.render(messages, add_generation_prompt, tools)
        return text, [Segment(0, len(text), "unknown")] if text else []

    def digest(self) -> str:
        raise NotImplementedError


class SimpleChatTemplate(ChatTemplate):
    """The built-in template: role markers from `ByteTokenizer`'s special tokens.

    ```
    <|system|>\\n{content}<|end|>\\n        (each leading system message)
    <|tools|>\\n{tool json}\\n...<|end|>\\n  (if tools are given, in the order given)
    <|user|>\\n{content}<|end|>\\n          (each further message, any role)
    <|assistant|>\\n                        (the generation prompt)
    ```
    Tools are rendered in the order given, key order preserved, so a caller that shuffles its
    tool list changes the prompt, exactly as most real templates do.
    """

    name = "simple"
    version = "prefixkv-simple/1"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        return self.render_with_segments(messages, add_generation_prompt, tools)[0]

    def render_with_segments(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[str, Sequence[Segment]]:
        messages, tools = checked_input(messages, tools)
        # Written to one buffer, and template spans merged as they come, into columns
        # (`Segments`): a conversation of 600,000 short messages is three spans each, and
        # holding them as objects cost hundreds of bytes per character of the trace line.
        out = io.StringIO()
        segments = Segments()
        pos = 0

        def emit(text: str, source: str, index: int | None = None, role: str | None = None):
            nonlocal pos
            if not text:
                return
            out.write(text)
            end = pos + len(text)
            segments.add(pos, end, source, index, role)
            pos = end

        def emit_tools() -> None:
            if not tools:
                return
            emit("<|tools|>\n", "template")
            for i, tool in enumerate(tools):
                emit(json.dumps(tool, ensure_ascii=False), "tool", i)
                emit("\n", "template")
            emit("<|end|>\n", "template")

        tools_done = False
        for i, message in enumerate(messages):
            role = str(message.get("role", ""))
            if role != "system" and not tools_done:
                emit_tools()
                tools_done = True
            emit(f"<|{role}|>\n", "template")
            emit(message_text(message), "message", i, role)
            emit("<|end|>\n", "template")
        if not tools_done:
            emit_tools()
        if add_generation_prompt:
            emit("<|assistant|>\n", "template")
        return out.getvalue(), segments

    def digest(self) -> str:
        return hashlib.sha256(self.version.encode()).hexdigest()

    def __repr__(self) -> str:
        return "SimpleChatTemplate()"


#: Base limits of one Jinja render; `JinjaChatTemplate` adds to them in proportion to the input.
DEFAULT_MAX_OUTPUT_CHARS = 1_000_000
DEFAULT_MAX_STEPS = 1_000_000
DEFAULT_MAX_RENDER_SECONDS = 10.0
#: Added per input character / per message or tool: a long conversation is not hostile.
_CHARS_PER_INPUT_CHAR = 8
_STEPS_PER_ITEM = 1_000
_MAX_STRFTIME_FORMAT = 256


class JinjaChatTemplate(ChatTemplate):
    """A Hugging Face style Jinja chat template, run in a bounded immutable sandbox.

    Templates come from checkpoints and users, so rendering one is bounded (see
    `prefixkv.text.sandbox`): at most `max_steps` loop iterations and calls, no string, list
    or output over `max_output_chars`, at most `max_seconds` of wall time. The first two grow
    with the input (plus 1,000 steps per message or tool, plus 8 characters per character of
    input), so that only a template that costs out of proportion to its input is stopped. Every
    failure to compile or render, whatever Python raised, is a `ChatTemplateError`.
    """

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        name: str = "jinja",
        extra_context: Mapping[str, Any] | None = None,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        max_steps: int = DEFAULT_MAX_STEPS,
        max_seconds: float = DEFAULT_MAX_RENDER_SECONDS,
    ) -> None:
        try:
            import jinja2
            import jinja2.ext

            from prefixkv.text.sandbox import BoundedEnvironment
        except ImportError as exc:
            raise _missing_jinja() from exc

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(f"chat template {name}: {message}")

        def tojson(
            value: Any,
            ensure_ascii: bool = False,
            indent: int | None = None,
            separators: tuple[str, str] | None = None,
            sort_keys: bool = False,
        ) -> str:
            # Hugging Face's tojson: no HTML escaping, unlike jinja2's built-in filter.
            if indent is not None and not (isinstance(indent, int) and 0 <= indent <= 64):
                raise ChatTemplateError(f"chat template {name}: tojson indent {indent!r}")
            return json.dumps(
                value,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        def strftime_now(fmt: str) -> str:
            if not isinstance(fmt, str) or len(fmt) > _MAX_STRFTIME_FORMAT:
                raise ChatTemplateError(
                    f"chat template {name}: strftime_now takes a format string of at most "
                    f"{_MAX_STRFTIME_FORMAT} characters, got {type(fmt).__name__}"
                )
            return _dt.datetime.now().strftime(fmt)

        env = BoundedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.add_filter("tojson", tojson)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"chat template {name}: syntax error at line {exc.lineno}: {exc.message}"
            ) from exc
        except Exception as exc:  # deep nesting: RecursionError, MemoryError in compile()
            raise ChatTemplateError(
                f"chat template {name}: cannot compile: {type(exc).__name__}: {exc}"
            ) from exc
        self._environment = env
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name
        self.extra_context = dict(extra_context or {})
        for limit_name, value in (("max_output_chars", max_output_chars), ("max_steps", max_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(f"{limit_name} must be a positive int, got {value!r}")
        if not (isinstance(max_seconds, (int, float)) and max_seconds > 0):
            raise InvalidInputError(f"max_seconds must be a positive number, got {max_seconds!r}")
        self.max_output_chars = max_output_chars
        self.max_steps = max_steps
        self.max_seconds = float(max_seconds)
        self.version = f"jinja/{self.digest()[:12]}"

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], *, bos_token: str = "", eos_token: str = ""
    ) -> JinjaChatTemplate:
        """A template file (.jinja, .j2, ...), or a Hugging Face `tokenizer_config.json` whose
        `chat_template` (and `bos_token` / `eos_token`) are used."""
        path = Path(path)
        try:
            raw = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidInputError(f"cannot read chat template {path}: {exc}") from exc
        if path.suffix == ".json":
            return cls._from_tokenizer_config(path, raw)
        return cls(raw, bos_token=bos_token, eos_token=eos_token, name=str(path))

    @classmethod
    def _from_tokenizer_config(cls, path: Path, raw: str) -> JinjaChatTemplate:
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ChatTemplateError(f"{path}: not valid JSON: {exc}") from exc
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            raise ChatTemplateError(f"{path}: no 'chat_template' string in it")
        tokens = special_tokens(config)
        return cls(
            template,
            bos_token=tokens.pop("bos_token", ""),
            eos_token=tokens.pop("eos_token", ""),
            name=str(path),
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        checked_messages, checked_tools = checked_input(messages, tools)
        try:
            context: dict[str, Any] = {
                **self.extra_context,
                "messages": [dict(m) for m in checked_messages],
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
            }
            if checked_tools is not None:
                context["tools"] = [dict(t) for t in checked_tools]
            limits = self._limits(checked_messages, checked_tools)
            return self._environment.run(self._template, context, limits, self.name)
        except ChatTemplateError:
            raise
        except Exception as exc:  # whatever the template made Python raise
            raise ChatTemplateError(
                f"chat template {self.name}: {type(exc).__name__}: {exc}"
            ) from exc

    def _limits(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> RenderLimits:
        from prefixkv.text.sandbox import RenderLimits

        items = [*messages, *(tools or ())]
        input_chars = sum(len(json.dumps(item, default=str)) for item in items)
        return RenderLimits(
            max_chars=self.max_output_chars + _CHARS_PER_INPUT_CHAR * input_chars,
            max_steps=self.max_steps + _STEPS_PER_ITEM * len(items),
            max_seconds=self.max_seconds,
        )

    def render_with_segments(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[str, Sequence[Segment]]:
        text = self.render(messages, add_generation_prompt, tools)
        return text, attribute(
            text,
            messages,
            tools,
            lambda wrapped: self.render(wrapped, add_generation_prompt, tools),
        )

    def digest(self) -> str:
        described: dict[str, Any] = {
            "template": self.source,
            "bos": self.bos_token,
            "eos": self.eos_token,
        }
        if self.extra_context:  # only when present, so existing digests stay as they were
            described["extra"] = self.extra_context
        payload = json.dumps(described, sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()

    def __repr__(self) -> str:
        return f"JinjaChatTemplate(name={self.name!r})"


def load_chat_template(
    spec: str | os.PathLike[str] | None,
    *,
    bos_token: str = "",
    eos_token: str = "",
) -> ChatTemplate:
    """None (or "simple") gives the built-in template; a path gives a `JinjaChatTemplate`."""
    if spec is None or str(spec) == "simple":
        return SimpleChatTemplate()
    path = Path(spec)
    if not path.is_file():
        raise InvalidInputError(
            f"chat template {str(spec)!r}: expected 'simple' or a template file, and {path} "
            "does not exist"
        )
    return JinjaChatTemplate.from_file(path, bos_token=bos_token, eos_token=eos_token)


#: Special tokens transformers passes to a chat template (its ``special_tokens_map``).
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens of a ``tokenizer_config.json``, as strings (an `AddedToken` is
    written as an object with a ``content``)."""
    tokens: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


class ChatTemplateSet(ChatTemplate):
    """A checkpoint's named templates, chosen per request as transformers chooses: the
    ``tool_use`` template when tools are given and it exists, else ``default``."""

    def __init__(self, templates: Mapping[str, JinjaChatTemplate], *, name: str) -> None:
        if not templates:
            raise ChatTemplateError(f"{name}: an empty set of chat templates")
        self.templates = dict(sorted(templates.items()))
        self.name = name
        self.version = f"jinja-set/{self.digest()[:12]}"

    def select(self, tools: Sequence[Mapping[str, Any]] | None) -> JinjaChatTemplate:
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatTemplateError(
            f"{self.name}: several chat templates and none named 'default' "
            f"(available: {sorted(self.templates)})"
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        return self.select(tools).render(messages, add_generation_prompt, tools)

    def render_with_segments(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[str, Sequence[Segment]]:
        return self.select(tools).render_with_segments(messages, add_generation_prompt, tools)

    def digest(self) -> str:
        payload = json.dumps({name: t.digest() for name, t in self.templates.items()})
        return hashlib.sha256(payload.encode()).hexdigest()

    def __repr__(self) -> str:
        return f"ChatTemplateSet(name={self.name!r}, templates={sorted(self.templates)})"
