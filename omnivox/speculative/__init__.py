"""Speculative decoding of the Thinker: the drafter protocol (`drafter.py`) and its methods,
prompt lookup (`ngram.py`) and the learned block drafter DFlash (`dflash/`). `make_drafter`
builds the configured one."""
from __future__ import annotations
