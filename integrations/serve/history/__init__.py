"""Token-exact history: what the next turn of a conversation will send (``forms``), the work that
computes it into the cache after a reply (``work``), and the past forms by their tokens
(``index``)."""
