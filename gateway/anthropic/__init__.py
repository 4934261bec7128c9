"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): request models and their
translation into the shared conversation, the wire (a whole message or its stream of events),
and the routes over the one generation path."""
