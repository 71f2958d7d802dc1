"""The protocols the server speaks, one adapter each (``openai``, ``anthropic``), and what their
request models share (``schema``)."""
