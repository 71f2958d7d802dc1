"""One request's way through the server, whatever its protocol: its ``Job``, its run, its output
(text, stop strings, tool calls, structured output) and the rendering of its prompt."""
