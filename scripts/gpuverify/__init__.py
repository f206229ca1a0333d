"""The phases of scripts/gpu_verify.py (one module per concern; see that script)."""
