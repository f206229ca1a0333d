"""What the lent GPU machine lacks (its image has torch, triton, transformers, numpy, safetensors,
tokenizers, jinja2, tqdm, scipy and pillow, but no audio-file or HTTP-server packages), and a
prelude that makes a child Python behave as if they were absent: `sys.modules[name] = None`
makes `import name` raise ModuleNotFoundError and `importlib.util.find_spec(name)` return None,
as on that machine."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABSENT = ("soundfile", "fastapi", "uvicorn", "pydantic", "starlette")
PRELUDE = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
           f"[sys.modules.__setitem__(n, None) for n in {ABSENT!r}]; ")


def python(code: str) -> list[str]:
    """argv of a child Python running `code` after the prelude."""
    return [sys.executable, "-c", PRELUDE + code]
