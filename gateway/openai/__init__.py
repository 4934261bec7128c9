"""OpenAI's chat completions, completions and models endpoints: request models, the wire
(whole answers and streamed chunks), and the routes over the one generation path."""
