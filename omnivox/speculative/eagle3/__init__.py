"""EAGLE-3 (SafeAILab's head, as SGLang and vLLM's `speculators` store it) for the Thinker: its
checkpoint layouts (`config.py`), the head (`model.py`) and the drafter on the protocol, a chain
of draft steps (`drafter.py`)."""
