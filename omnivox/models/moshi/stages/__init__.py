"""Moshi on the engine: Mimi's encoder -> the LM (temporal transformer + depformer) -> Mimi's decoder."""
