"""Kyutai's Moshi (full-duplex speech): Mimi, the streaming codec (`mimi`), and the LM."""
