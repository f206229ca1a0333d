"""Qwen3-Omni on the engine's stages: the Thinker and the Talker as adapters of the paged AR
stage, Code2Wav as the vocoder's adapter, and the graph that joins them (`graph.build`)."""
