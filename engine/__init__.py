"""The engine worker process: one llama.cpp context, continuous batching, and the moves of KV
between the context and the shared block pool. It never imports the HTTP side."""
