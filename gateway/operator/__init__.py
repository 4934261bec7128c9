"""Endpoints beside the three APIs, for operators and tools: the cache admin API and the live
cache page (behind --admin-key), why a prompt misses the cache (/v1/cache/explain), and
llama-server's /tokenize, /detokenize and /apply-template."""
