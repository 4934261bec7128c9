"""prefixgate: an OpenAI-compatible gateway for local GGUF models."""
