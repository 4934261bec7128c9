"""A prefixgate node as an NVIDIA Dynamo worker (docs/dynamo.md)."""
