"""Fish Audio S2 Pro (Dual-AR TTS): slow AR over time, fast AR over codebooks, causal DAC codec.

NOTE: the S2 Pro weights are under the Fish Audio Research License (non-commercial only; any
commercial use, hosted services included, needs a written licence from Fish Audio).
"""

LICENSE_NOTICE = ("Fish Audio S2 Pro weights are licensed under the Fish Audio Research License: "
                  "research and non-commercial use only; commercial use needs a licence from Fish Audio")
