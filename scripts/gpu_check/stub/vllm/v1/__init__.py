"""Stub package (see vllm/__init__.py)."""
