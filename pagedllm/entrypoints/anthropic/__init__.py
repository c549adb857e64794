"""Anthropic's Messages API (``/v1/messages``) on the OpenAI server's chat path."""
