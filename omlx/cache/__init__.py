"""Prefix cache: token blocks, their chained keys, and the tiers that hold their KV data."""
