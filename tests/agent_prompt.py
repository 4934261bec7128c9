"""The system prompt the agent CLI tests give Claude Code and Codex in place of their own (too
long for the test model's speed): natural, ~800 tokens, so that many whole blocks are shared
between sessions, and one the test model answers briefly under (greedy, it answers the tests'
questions in a sentence)."""

BOATS = [(colour, name) for colour in ("red", "blue", "green", "white", "black", "grey")
         for name in ("Aino", "Helmi", "Tuuli", "Meri", "Saga")]
HARBOUR_PROMPT = "You are a helpful assistant. Answer in one short sentence.\n\n" + "\n".join(
    f"- Berth {i}: the {colour} boat {name} is moored here; it leaves at {6 + i % 10} o'clock."
    for i, (colour, name) in enumerate(BOATS))
