"""Qwen3-Omni as engine stages: encode+think -> talk (code predictor inner loop) -> vocode."""
