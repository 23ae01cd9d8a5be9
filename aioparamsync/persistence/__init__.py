"""Durability: the write-ahead log, safetensors snapshots, and recovery from them."""
