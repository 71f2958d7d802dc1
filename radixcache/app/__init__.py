"""The application on top of everything: the ``radixcache`` command line (``cli``), the agent-loop
demo (``demo``, ``demo_agent``) and the ``kv-size`` calculator (``kv_size``, ``kv_size_table``)."""
