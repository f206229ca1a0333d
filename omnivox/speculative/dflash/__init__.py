"""DFlash (z-lab's block-diffusion drafter) for the Thinker: its checkpoint layout (`config.py`),
the draft network (`model.py`) and the drafter on the protocol (`drafter.py`)."""
