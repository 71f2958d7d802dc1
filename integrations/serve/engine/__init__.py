"""The server's side of the engine: ``client`` (``EngineClient``, the one interface the server
calls, in the engine's own types) and ``local`` (``LocalEngine``: the engine of a wrapped model in
this process, stepped by one scheduler thread)."""
