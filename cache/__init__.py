"""The prefix cache as a library of blocks, tokens and bytes; it does not import llama.cpp."""
