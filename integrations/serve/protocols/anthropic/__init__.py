"""Anthropic's Messages API: its request models (``requests``), their conversion into the server's
one conversation form (``convert``) and the adapter (``messages``)."""
