"""The HTTP edge: who is asking (API keys, tenants), browsers (CORS), how often (rate limits),
errors in each API's own shape, and the Prometheus metrics."""
