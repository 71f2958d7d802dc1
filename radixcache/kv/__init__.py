"""Paged KV storage (needs torch): the block pool and its transformers ``Cache`` adapter."""
