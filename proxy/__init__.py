"""Recording proxy: OpenAI/Anthropic-compatible ASGI app that records every model call with token ids."""
