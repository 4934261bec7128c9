"""prefixgate: an OpenAI- and Anthropic-compatible gateway for local GGUF models
(/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages) with a shared prefix KV
cache."""
