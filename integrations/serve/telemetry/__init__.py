"""What the server tells operators and routers: Prometheus ``metrics``, ``loads`` (``/v1/loads``
for SGLang's model gateway) and the ``token_log`` (``--log-token-ids``)."""
