"""Text to tokens: tokenizers and chat templates, with the provenance the analyzer needs.

The cache matches token ids, so two requests share KV only if the same tokenizer turned the same
rendered text into the same ids. Everything here exists to make that chain explicit:

* A tokenizer has a `digest()`: the cache context must include it, because the same ids from two
  different vocabularies are different prompts. `ByteTokenizer` (the built-in default, no
  dependencies) hashes a description of its vocabulary; `HFTokenizer` hashes the bytes of the
  user's `tokenizer.json`.
* A chat template has a `digest()` too, and `render_segments` says which character span of the
  rendered text came from which message or tool, and which from the template itself. The analyzer
  maps a divergence token back through the tokenizer's character offsets to one of these segments
  to say "the prompts part ways inside message 0 (system)" rather than "at token 37".

Jinja templates are run in jinja2's immutable sandbox, bounded in steps, size and time
(`prefixkv.jinja_sandbox`; every failure is a `ChatTemplateError`), with the variables Hugging
Face templates expect (`messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token`,
`raise_exception`, `strftime_now`). Their segments are found by rendering once more with each
message's content wrapped in private-use sentinel characters and locating the sentinels; a
template that transforms content (strip, upper...) breaks the sentinels, and then each content
string is searched for in the plain render instead; when even that fails the segment is
"unknown". `tokenizers` and `jinja2` are optional dependencies (`prefixkv[hf]`), imported only
when a user's tokenizer or template is loaded.
"""

from __future__ import annotations

import bisect
import datetime as _dt
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from prefixkv.errors import ChatTemplateError, InvalidInputError, MissingDependencyError

if TYPE_CHECKING:
    from prefixkv.jinja_sandbox import RenderLimits

__all__ = [
    "CHECKPOINT_TEMPLATE_SOURCES",
    "ByteTokenizer",
    "ChatTemplate",
    "ChatTemplateSet",
    "HFTokenizer",
    "JinjaChatTemplate",
    "Segment",
    "SimpleChatTemplate",
    "Tokenizer",
    "find_chat_template",
    "load_chat_template",
    "load_tokenizer",
    "message_text",
    "segment_at",
]

Offsets = list[tuple[int, int]]


def _missing(package: str, feature: str) -> MissingDependencyError:
    return MissingDependencyError(
        f"{feature} needs the '{package}' package: pip install 'prefixkv[hf]'"
    )


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


@runtime_checkable
class Tokenizer(Protocol):
    """What the analyzer needs from a tokenizer."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]:
        """Token ids and, per token, the (start, end) character span of `text` it came from."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def digest(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus a few special tokens matched as whole strings.

    The special tokens are the built-in chat template's role markers, so a rendered role header
    costs one token rather than a dozen bytes. Like Hugging Face's added tokens, a special token's
    text inside user content is also encoded as the special id; that is fine for measuring reuse,
    which only needs encoding to be deterministic.
    """

    SPECIAL_TOKENS: tuple[str, ...] = (
        "<|bos|>",
        "<|eos|>",
        "<|end|>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|tool|>",
        "<|tools|>",
    )
    VERSION = "prefixkv-bytes/1"

    def __init__(self) -> None:
        self._special_ids = {tok: 256 + i for i, tok in enumerate(self.SPECIAL_TOKENS)}
        self._special_text = {i: tok for tok, i in self._special_ids.items()}
        self._special_re = re.compile("|".join(re.escape(t) for t in self.SPECIAL_TOKENS))

    @property
    def name(self) -> str:
        return "bytes"

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIAL_TOKENS)

    @property
    def bos_token(self) -> str:
        return "<|bos|>"

    @property
    def eos_token(self) -> str:
        return "<|eos|>"

    def token_to_id(self, token: str) -> int | None:
        return self._special_ids.get(token)

    def encode(self, text: str) -> list[int]:
        return self.encode_with_offsets(text)[0]

    def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]:
        ids: list[int] = []
        offsets: Offsets = []
        pos = 0
        for match in self._special_re.finditer(text):
            self._encode_plain(text, pos, match.start(), ids, offsets)
            ids.append(self._special_ids[match.group()])
            offsets.append((match.start(), match.end()))
            pos = match.end()
        self._encode_plain(text, pos, len(text), ids, offsets)
        return ids, offsets

    @staticmethod
    def _encode_plain(text: str, start: int, end: int, ids: list[int], offsets: Offsets) -> None:
        if start == end:
            return
        chunk = text[start:end]
        if chunk.isascii():  # the common case: one byte per character
            ids.extend(chunk.encode("ascii"))
            offsets.extend((i, i + 1) for i in range(start, end))
            return
        for i, char in enumerate(chunk, start):
            encoded = char.encode("utf-8", "surrogatepass")
            ids.extend(encoded)
            offsets.extend([(i, i + 1)] * len(encoded))

    def decode(self, ids: Sequence[int]) -> str:
        parts: list[str] = []
        pending = bytearray()
        for token in ids:
            token = int(token)
            if 0 <= token < 256:
                pending.append(token)
                continue
            if pending:
                parts.append(pending.decode("utf-8", "replace"))
                pending.clear()
            parts.append(self._special_text.get(token, f"<|{token}|>"))
        if pending:
            parts.append(pending.decode("utf-8", "replace"))
        return "".join(parts)

    def digest(self) -> str:
        description = json.dumps(
            {
                "version": self.VERSION,
                "bytes": "utf-8 bytes are ids 0..255",
                "special_tokens": list(self.SPECIAL_TOKENS),
                "special_ids_from": 256,
                "normalisation": "none",
            },
            sort_keys=True,
        )
        return hashlib.sha256(description.encode()).hexdigest()

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, through the `tokenizers` package.

    Text is encoded with `add_special_tokens=False`: chat templates already render the BOS token
    into the text, and a text trace holds exactly what the engine tokenizes.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:
            raise _missing("tokenizers", "a Hugging Face tokenizer.json") from exc
        self.path = Path(path)
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise InvalidInputError(f"cannot read tokenizer file {self.path}: {exc}") from exc
        self._digest = hashlib.sha256(data).hexdigest()
        try:
            self._tokenizer = _HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # tokenizers raises a plain Exception on a bad file
            raise InvalidInputError(f"{self.path} is not a valid tokenizer.json: {exc}") from exc

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        token_id = self._tokenizer.token_to_id(token)
        return None if token_id is None else int(token_id)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]:
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), [(int(s), int(e)) for s, e in encoding.offsets]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False))

    def digest(self) -> str:
        return self._digest

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def load_tokenizer(spec: str | os.PathLike[str] | None) -> ByteTokenizer | HFTokenizer:
    """None (or "bytes") gives the built-in `ByteTokenizer`; a tokenizer.json, or a directory
    holding one, gives an `HFTokenizer`."""
    if spec is None or str(spec) == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise InvalidInputError(
            f"tokenizer {str(spec)!r}: expected 'bytes', a tokenizer.json file or a directory "
            f"holding one, and {path} does not exist"
        )
    return HFTokenizer(path)


# --------------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """A character span `[start, end)` of a rendered prompt and where it came from.

    `source` is "message" (the content of `messages[index]`, whose role is `role`), "tool"
    (`tools[index]`), "template" (text the template added: role markers, separators) or
    "unknown" (the template's output could not be attributed).
    """

    start: int
    end: int
    source: str
    index: int | None = None
    role: str | None = None

    @property
    def label(self) -> str:
        if self.source == "message":
            return f"message {self.index} ({self.role})"
        if self.source == "tool":
            return f"tool {self.index}"
        return self.source


def segment_at(segments: Sequence[Segment], char: int) -> Segment | None:
    """The segment containing character `char` (the last segment for the end of the text)."""
    if not segments:
        return None
    starts = [segment.start for segment in segments]
    i = bisect.bisect_right(starts, char) - 1
    if i < 0:
        return segments[0]
    return segments[i]


def message_text(message: Mapping[str, Any]) -> str:
    """A message's content as one string: a string as-is, None as "", OpenAI content parts
    joined (text parts only)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return str(content)


def _fill_gaps(spans: list[Segment], length: int, gap_source: str) -> list[Segment]:
    """Sort non-overlapping spans and fill the gaps so the segments tile [0, length)."""
    spans = sorted((s for s in spans if s.end > s.start), key=lambda s: s.start)
    out: list[Segment] = []
    pos = 0
    for span in spans:
        if span.start < pos:  # overlapping attribution: keep the earlier one
            continue
        if span.start > pos:
            out.append(Segment(pos, span.start, gap_source))
        out.append(span)
        pos = span.end
    if pos < length:
        out.append(Segment(pos, length, gap_source))
    return out


class ChatTemplate:
    """Turns OpenAI-style messages (and optional tool schemas) into prompt text."""

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
    ) -> list[Segment]:
        return self.render_with_segments(messages, add_generation_prompt, tools)[1]

    def render_with_segments(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[str, list[Segment]]:
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
    ) -> tuple[str, list[Segment]]:
        parts: list[str] = []
        segments: list[Segment] = []
        pos = 0

        def emit(text: str, source: str, index: int | None = None, role: str | None = None):
            nonlocal pos
            if text:
                parts.append(text)
                segments.append(Segment(pos, pos + len(text), source, index, role))
                pos += len(text)

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
        return "".join(parts), _merge_adjacent(segments)

    def digest(self) -> str:
        return hashlib.sha256(self.version.encode()).hexdigest()

    def __repr__(self) -> str:
        return "SimpleChatTemplate()"


def _merge_adjacent(segments: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for segment in segments:
        if out and out[-1].source == "template" and segment.source == "template":
            out[-1] = Segment(out[-1].start, segment.end, "template")
        else:
            out.append(segment)
    return out


# Private-use characters: a real prompt practically never contains them, and no string filter
# a template might apply (trim, upper) changes them.
_OPEN, _SEP, _CLOSE = "\ue000", "\ue001", "\ue002"
_SENTINEL_RE = re.compile(f"{_OPEN}(\\d+){_SEP}(.*?){_CLOSE}", re.DOTALL)


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
    `prefixkv.jinja_sandbox`): at most `max_steps` loop iterations and calls, no string, list
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

            from prefixkv.jinja_sandbox import BoundedEnvironment
        except ImportError as exc:
            raise _missing("jinja2", "a Jinja chat template") from exc

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
        tokens = _special_tokens(config)
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
        context: dict[str, Any] = {
            **self.extra_context,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        if tools is not None:
            context["tools"] = [dict(t) for t in tools]
        limits = self._limits(messages, tools)
        try:
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
        from prefixkv.jinja_sandbox import RenderLimits

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
    ) -> tuple[str, list[Segment]]:
        text = self.render(messages, add_generation_prompt, tools)
        spans = self._sentinel_spans(text, messages, add_generation_prompt, tools)
        if spans is None:
            spans = _search_spans(text, messages)
        if spans is None:
            return text, [Segment(0, len(text), "unknown")] if text else []
        spans.extend(_tool_spans(text, tools, spans))
        return text, _merge_adjacent(_fill_gaps(spans, len(text), "template"))

    def _sentinel_spans(
        self,
        text: str,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> list[Segment] | None:
        """Render with each message's content wrapped in sentinels; None unless removing the
        sentinels gives back exactly `text` (the template did not transform any content)."""
        wrapped: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            content = message.get("content")
            copy = dict(message)
            if isinstance(content, str):
                if any(c in content for c in (_OPEN, _SEP, _CLOSE)):
                    return None
                copy["content"] = f"{_OPEN}{i}{_SEP}{content}{_CLOSE}"
            elif isinstance(content, list):
                copy["content"] = [
                    {**part, "text": f"{_OPEN}{i}{_SEP}{part['text']}{_CLOSE}"}
                    if isinstance(part, Mapping) and isinstance(part.get("text"), str)
                    else part
                    for part in content
                ]
            wrapped.append(copy)
        try:
            marked = self.render(wrapped, add_generation_prompt, tools)
        except InvalidInputError:
            return None
        spans: list[Segment] = []
        plain: list[str] = []
        pos = 0  # position in `marked`
        out_pos = 0  # position in the text without sentinels
        for match in _SENTINEL_RE.finditer(marked):
            before = marked[pos : match.start()]
            plain.append(before)
            out_pos += len(before)
            index = int(match.group(1))
            if index >= len(messages):
                return None
            content = match.group(2)
            role = str(messages[index].get("role", ""))
            spans.append(Segment(out_pos, out_pos + len(content), "message", index, role))
            plain.append(content)
            out_pos += len(content)
            pos = match.end()
        plain.append(marked[pos:])
        stripped = "".join(plain)
        if stripped != text or any(c in stripped for c in (_OPEN, _SEP, _CLOSE)):
            return None
        return spans

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


def _search_spans(text: str, messages: Sequence[Mapping[str, Any]]) -> list[Segment] | None:
    """Fallback attribution: find each message's content, in order, in the rendered text
    (as-is, then stripped). None if any non-empty content cannot be found."""
    spans: list[Segment] = []
    pos = 0
    for i, message in enumerate(messages):
        content = message_text(message)
        role = str(message.get("role", ""))
        for candidate in (content, content.strip()):
            if not candidate:
                break
            found = text.find(candidate, pos)
            if found >= 0:
                spans.append(Segment(found, found + len(candidate), "message", i, role))
                pos = found + len(candidate)
                break
        else:
            return None
    return spans


def _tool_spans(
    text: str, tools: Sequence[Mapping[str, Any]] | None, taken: Sequence[Segment]
) -> list[Segment]:
    """Tool schemas as templates usually print them (compact, or indented JSON)."""
    if not tools:
        return []
    out: list[Segment] = []
    occupied = [(s.start, s.end) for s in taken]
    for i, tool in enumerate(tools):
        for indent in (None, 4, 2):
            rendered = json.dumps(tool, ensure_ascii=False, indent=indent)
            found = text.find(rendered)
            if found < 0:
                continue
            end = found + len(rendered)
            if any(found < e and s < end for s, e in occupied):
                continue
            out.append(Segment(found, end, "tool", i))
            occupied.append((found, end))
            break
    return out


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


# --------------------------------------------------------------------------------------------
# The chat template a Hugging Face checkpoint ships
# --------------------------------------------------------------------------------------------

#: Where `find_chat_template` looks, in transformers' order of priority.
CHECKPOINT_TEMPLATE_SOURCES = (
    "chat_template.jinja",
    "additional_chat_templates/*.jinja",
    "'chat_template' in tokenizer_config.json",
    "chat_template.json",
)

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


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
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
    ) -> tuple[str, list[Segment]]:
        return self.select(tools).render_with_segments(messages, add_generation_prompt, tools)

    def digest(self) -> str:
        payload = json.dumps({name: t.digest() for name, t in self.templates.items()})
        return hashlib.sha256(payload.encode()).hexdigest()

    def __repr__(self) -> str:
        return f"ChatTemplateSet(name={self.name!r}, templates={sorted(self.templates)})"


def find_chat_template(
    directory: str | os.PathLike[str],
) -> JinjaChatTemplate | ChatTemplateSet | None:
    """The chat template a Hugging Face checkpoint directory ships, or None if it has none.

    Found as transformers' tokenizer finds it: ``chat_template.jinja`` (the default template)
    and ``additional_chat_templates/<name>.jinja`` take priority over the ``chat_template`` of
    ``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}``); a processor's
    legacy ``chat_template.json`` comes last. The special tokens of ``tokenizer_config.json``
    (``bos_token``, ``eos_token``, ``pad_token``...) are passed to the template, as transformers
    passes them. Several templates give a `ChatTemplateSet`.
    """
    root = Path(directory)
    config_path = root / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ChatTemplateError(f"cannot read {config_path}: {exc}") from exc
        if isinstance(loaded, dict):
            config = loaded
    tokens = _special_tokens(config)

    sources: dict[str, tuple[str, str]] = {}  # template name -> (source text, where from)

    def read(path: Path) -> str:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"cannot read chat template {path}: {exc}") from exc

    if (root / "chat_template.jinja").is_file():
        sources["default"] = (read(root / "chat_template.jinja"), str(root / "chat_template.jinja"))
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            sources[path.name.removesuffix(".jinja")] = (read(path), str(path))
    if not sources and config.get("chat_template"):
        entry = config["chat_template"]
        where = str(config_path)
        if isinstance(entry, str):
            sources["default"] = (entry, where)
        elif isinstance(entry, list):
            for item in entry:
                if not (
                    isinstance(item, Mapping)
                    and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)
                ):
                    raise ChatTemplateError(
                        f"{config_path}: a chat_template list holds {{'name', 'template'}} "
                        f"objects, got {item!r:.80}"
                    )
                sources[item["name"]] = (item["template"], f"{where}[{item['name']}]")
        else:
            raise ChatTemplateError(
                f"{config_path}: chat_template must be a string or a list of named templates"
            )
    legacy = root / "chat_template.json"
    if not sources and legacy.is_file():
        try:
            entry = json.loads(read(legacy)).get("chat_template")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ChatTemplateError(f"{legacy}: not a JSON object: {exc}") from exc
        if not isinstance(entry, str):
            raise ChatTemplateError(f"{legacy}: no 'chat_template' string in it")
        sources["default"] = (entry, str(legacy))
    if not sources:
        return None

    bos_token = tokens.pop("bos_token", "")
    eos_token = tokens.pop("eos_token", "")
    templates = {
        name: JinjaChatTemplate(
            source, bos_token=bos_token, eos_token=eos_token, name=where, extra_context=tokens
        )
        for name, (source, where) in sources.items()
    }
    if list(templates) == ["default"]:
        return templates["default"]
    return ChatTemplateSet(templates, name=str(root))
