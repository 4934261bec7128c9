"""The engine workers from the HTTP process's side: starting and supervising the worker
processes, choosing one for each request (prefix, prompt_cache_key affinity, load), the shared
block pool they all read, the queue a request's outputs arrive on, and fetching the default
model."""
