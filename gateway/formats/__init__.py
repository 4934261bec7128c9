"""What the model reads and writes: the chat template that renders a conversation into prompt
tokens, the model's own output format (its reasoning and tool calls, recognised from the
template), the grammars that hold tool calls and `response_format` to their schema, and the tools
a request offers."""
