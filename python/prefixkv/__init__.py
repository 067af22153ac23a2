"""prefixkv: exact, safe, fast prefix caching for LLM inference engines."""
