"""What an `Engine` request is and how it becomes prompt token ids; which chat template and stop
tokens an engine uses.

A request is token ids (a list, numpy array or tensor), text, a list of chat messages, or
``{"messages": [...], "tools": [...]}``; wrapped in an `EngineRequest` it also names its tenant
(`salt`) and LoRA adapter. Text goes through the engine's tokenizer; chat goes
through its chat template first. The template policy (`resolve_chat_template`) never renders a
conversation with a template the caller did not choose or the checkpoint did not ship: the
built-in template is only the default of the built-in tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefixkv.errors import ChatTemplateError, InvalidInputError, PrefixKVError
from prefixkv.text.tokenizers import ByteTokenizer, ChatTemplate, SimpleChatTemplate, Tokenizer

__all__ = [
    "EngineInput",
    "EngineRequest",
    "encode_request",
    "positive_int",
    "request_options",
    "resolve_chat_template",
    "stop_tokens",
]

#: A request: token ids, text, chat messages, or ``{"messages": [...], "tools": [...]}``.
EngineInput = Any


@dataclass(frozen=True)
class EngineRequest:
    """A request with what goes into its block keys besides its tokens.

    prompt: token ids, text, chat messages or ``{"messages": ...}`` (what `Engine.generate`
        also takes bare).
    salt: the tenant (str or bytes; equal bytes are the same tenant). Requests under different
        salts never share a KV block, however equal their prompts; None is the shared,
        unsalted space (`PrefixCache.add_request`'s `salt`).
    adapter: the name of a LoRA adapter loaded on the engine's model (`LlamaModel.load_adapter`):
        the request is served with it. None: the model's active adapter, as without a wrapper.
    """

    prompt: EngineInput
    salt: str | bytes | None = None
    adapter: str | None = None


def request_options(request: EngineInput, adapters: Sequence[str]) -> EngineRequest:
    """`request` as an `EngineRequest`, its salt and adapter checked (`adapters`: the names
    loaded on the model)."""
    if not isinstance(request, EngineRequest):
        return EngineRequest(request)
    if request.salt is not None and not isinstance(request.salt, (str, bytes)):
        raise InvalidInputError(f"salt must be a str, bytes or None, got {request.salt!r}")
    if request.adapter is not None:
        if not isinstance(request.adapter, str):
            raise InvalidInputError(f"adapter must be a str or None, got {request.adapter!r}")
        if request.adapter not in adapters:
            raise InvalidInputError(
                f"adapter {request.adapter!r} is not loaded on the model (loaded: "
                f"{', '.join(map(repr, adapters)) or 'none'}; see LlamaModel.load_adapter)"
            )
    return request


def _mappings(value: object, field: str) -> list[Mapping[str, Any]]:
    """A chat request's `messages` or `tools`: a list of mappings, refused by name otherwise."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise InvalidInputError(
            f"a chat request's {field} must be a list of mappings, got {type(value).__name__}"
        )
    for item in value:
        if not isinstance(item, Mapping):
            raise InvalidInputError(
                f"a chat request's {field} must hold mappings, got {type(item).__name__}"
            )
    return list(value)


def positive_int(value: object, name: str, minimum: int = 1) -> int:
    """An engine option that must be an int of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidInputError(f"{name} must be >= {minimum}, got {value}")
    return value


def stop_tokens(values: Sequence[int], vocab_size: int, what: str) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidInputError(f"{what} must be a sequence of token ids, got {values!r}")
    tokens = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise InvalidInputError(f"{what} must hold ints, got {value!r}")
        if not 0 <= int(value) < vocab_size:
            raise InvalidInputError(f"{what}: {value} is outside the vocabulary [0, {vocab_size})")
        tokens.append(int(value))
    return tuple(tokens)


def resolve_chat_template(
    template: ChatTemplate | str | None, tokenizer: Tokenizer | None, missing: str | None
) -> tuple[ChatTemplate | None, str]:
    """The engine's chat template, and why there is none when there is none.

    A template object is used as given; ``"simple"`` is the built-in `SimpleChatTemplate`; any
    other string is a template file or a checkpoint directory. With nothing given, the
    built-in template goes with the built-in `ByteTokenizer` (it is written for that
    tokenizer's special tokens), and with any other tokenizer there is no template: chat
    requests are refused rather than rendered in a format the model was not trained on.
    """
    from prefixkv.models.checkpoint import find_chat_template
    from prefixkv.text.tokenizers import load_chat_template

    if isinstance(template, ChatTemplate):
        return template, ""
    if isinstance(template, (str, Path)):
        if str(template) in ("simple", "builtin"):
            return SimpleChatTemplate(), ""
        if Path(template).is_dir():
            found = find_chat_template(template)
            if found is None:
                raise ChatTemplateError(f"no chat template in {template}")
            return found, ""
        return load_chat_template(template), ""
    if template is not None:
        raise InvalidInputError(
            f"chat_template must be a ChatTemplate, a path or 'simple', got {template!r}"
        )
    if missing is not None:
        return None, missing
    if isinstance(tokenizer, ByteTokenizer):
        return SimpleChatTemplate(), ""
    return None, (
        "this engine has no chat template (none was given, and the built-in one is written "
        "for the built-in ByteTokenizer, not this tokenizer)"
    )


def encode_request(
    request: EngineInput,
    *,
    tokenizer: Tokenizer | None,
    chat_template: ChatTemplate | None,
    no_template_reason: str,
    vocab_size: int,
) -> list[int]:
    """The prompt token ids of a request: ids as given, text tokenized, chat rendered."""

    def encode_text(text: str) -> list[int]:
        if tokenizer is None:
            raise InvalidInputError("this engine has no tokenizer: pass token ids")
        ids = tokenizer.encode(text)
        if not ids:
            raise InvalidInputError("the request's text encodes to no tokens")
        return ids

    def template() -> ChatTemplate:
        if chat_template is None:
            raise ChatTemplateError(
                f"a chat request, but {no_template_reason}; pass chat_template= (a "
                "ChatTemplate, a template file, or 'simple' for the built-in template)"
            )
        return chat_template

    def render(messages: object, tools: object) -> list[int]:
        messages = _mappings(messages, "messages")
        tools = None if tools is None else _mappings(tools, "tools")
        try:
            text = template().render(messages, add_generation_prompt=True, tools=tools)
        except PrefixKVError:
            raise
        except (TypeError, ValueError) as error:  # content a template cannot render
            raise ChatTemplateError(
                f"the chat request's messages or tools cannot be rendered: {error}"
            ) from error
        return encode_text(text)

    if isinstance(request, str):
        return encode_text(request)
    if isinstance(request, Mapping):
        if "messages" not in request:
            raise InvalidInputError("a chat request mapping needs a 'messages' list")
        unknown = sorted(map(repr, set(request) - {"messages", "tools"}))
        if unknown:
            raise InvalidInputError(
                f"a chat request mapping has unknown field(s) {', '.join(unknown)}: it takes "
                "'messages' and 'tools' (a tenant salt or adapter goes in an EngineRequest)"
            )
        return render(request["messages"], request.get("tools"))
    if isinstance(request, torch.Tensor):
        request = request.detach().cpu().numpy()
    if isinstance(request, np.ndarray):
        if request.ndim != 1 or request.dtype.kind not in "iu":
            raise InvalidInputError(
                f"token ids must be a 1-D integer array, got {request.dtype} {request.shape}"
            )
        ids = [int(token) for token in request.tolist()]
    elif isinstance(request, Sequence) and not isinstance(request, (bytes, bytearray)):
        if request and all(isinstance(item, Mapping) for item in request):
            return render(request, None)
        if not all(
            isinstance(item, (int, np.integer)) and not isinstance(item, bool) for item in request
        ):
            raise InvalidInputError(
                "a request must be token ids, text, chat messages or {'messages': ...}"
            )
        ids = [int(token) for token in request]
    else:
        raise InvalidInputError(
            f"a request must be token ids, text, chat messages or {{'messages': ...}}, "
            f"not {type(request).__name__}"
        )
    if not ids:
        raise InvalidInputError("a request needs at least one token")
    vocab = vocab_size
    bad = [token for token in ids if not 0 <= token < vocab]
    if bad:
        raise InvalidInputError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return ids
