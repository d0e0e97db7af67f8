"""Runtimes that execute plans with torch: the swap runtime and the chain runner."""
