"""OpenAI's protocols: chat completions and completions (``requests``, ``completions``, ``bodies``),
the Responses API (``responses_request``, ``responses``, ``response_store``) and the chat message
models they share (``messages``)."""
