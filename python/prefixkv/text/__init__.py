"""Text to tokens, with provenance: the layer between a user's messages and token ids.

- `tokenizers`: `ByteTokenizer` (built in) and `HFTokenizer` (a checkpoint's tokenizer.json),
  each with the digest the cache context includes.
- `chat`: chat templates (messages and tools to prompt text), with where each span came from.
- `sandbox`: the Jinja environment a hostile template cannot hang or escape.
- `segments`: which message or tool each character of a rendered prompt came from.

Needs no torch. Imports only `prefixkv.errors` below it. `prefixkv.text.tokenizers` keeps the names the
module of that name had.
"""

from prefixkv.text.tokenizers import (
    ByteTokenizer,
    ChatTemplate,
    ChatTemplateSet,
    HFTokenizer,
    JinjaChatTemplate,
    Segment,
    SimpleChatTemplate,
    Tokenizer,
    load_chat_template,
    load_tokenizer,
    message_text,
    segment_at,
)

__all__ = [
    "ByteTokenizer",
    "ChatTemplate",
    "ChatTemplateSet",
    "HFTokenizer",
    "JinjaChatTemplate",
    "Segment",
    "SimpleChatTemplate",
    "Tokenizer",
    "load_chat_template",
    "load_tokenizer",
    "message_text",
    "segment_at",
]
