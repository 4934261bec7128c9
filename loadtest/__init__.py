"""Load generation and benchmarks for OpenAI-compatible endpoints."""
