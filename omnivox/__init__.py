"""omnivox: a serving engine for omni speech models."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import omnivox` stays cheap for the CLI's --help
    if name in ("Omni", "OmniOutput"):
        from omnivox import omni
        return getattr(omni, name)
    if name in ("FishTTS", "TTSOutput"):
        from omnivox import tts
        return getattr(tts, name)
    raise AttributeError(name)
