"""omnivox: a serving engine for omni speech models."""


def __getattr__(name):  # lazy: `import omnivox` stays cheap for the CLI's --help
    if name == "__version__":  # the installed package's metadata (pyproject.toml's version)
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("omnivox")
        except PackageNotFoundError:  # a source tree that was never installed
            return "0+unknown"
    if name in ("Omni", "FishTTS", "OfflineModel"):
        from omnivox import offline
        return getattr(offline, name)
    if name == "Duplex":
        from omnivox.models.moshi.duplex import Duplex
        return Duplex
    if name == "Output":
        from omnivox.serving import Output
        return Output
    raise AttributeError(name)
