"""Adapters from radixcache to other systems (importable as ``radixcache.integrations.*``)."""
