"""A reference voice: the codec codes of a clip and its transcript, saved as one small `.npz`
(an int16 code array and a JSON header stored as bytes; read back with allow_pickle=False,
so loading a voice file never unpickles anything)."""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omnivox.errors import InputError

VOICE_FORMAT = "omnivox-fish-voice"
VOICE_VERSION = 1
MAX_VOICE_BYTES = 8 * 2**20  # ~20 min of codes; anything larger is not a voice file


@dataclass(frozen=True)
class Voice:
    codes: np.ndarray  # [num_codebooks, frames] int
    text: str  # transcript of the reference clip

    def __post_init__(self) -> None:
        c = np.asarray(self.codes)
        if c.ndim != 2 or c.shape[1] == 0 or not np.issubdtype(c.dtype, np.integer):
            raise InputError(f"voice codes must be a non-empty integer [num_codebooks, frames] array, "
                             f"got {c.dtype} {c.shape}")
        if int(c.min()) < 0 or int(c.max()) > np.iinfo(np.int16).max:
            raise InputError("voice codes must lie in [0, 32767]")
        if not isinstance(self.text, str):
            raise InputError("a voice's transcript must be a string")
        object.__setattr__(self, "codes", c.astype(np.int64))

    @property
    def frames(self) -> int:
        return int(self.codes.shape[1])

    def to_bytes(self) -> bytes:
        header = json.dumps({"format": VOICE_FORMAT, "version": VOICE_VERSION, "text": self.text})
        buf = io.BytesIO()
        np.savez(buf, codes=self.codes.astype(np.int16), header=np.frombuffer(header.encode(), dtype=np.uint8))
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Voice":
        if len(data) > MAX_VOICE_BYTES:
            raise InputError(f"voice file is {len(data)} bytes; the limit is {MAX_VOICE_BYTES}")
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                header = json.loads(bytes(z["header"].astype(np.uint8)).decode())
                codes = np.array(z["codes"])
        except Exception as e:  # zip, npy and json errors come in many types
            raise InputError(f"not an omnivox voice file ({type(e).__name__}: {e})") from None
        if not isinstance(header, dict) or header.get("format") != VOICE_FORMAT:
            raise InputError("not an omnivox voice file (missing format header)")
        if header.get("version") != VOICE_VERSION:
            raise InputError(f"voice file version {header.get('version')!r} is not supported (expected {VOICE_VERSION})")
        return cls(codes, header.get("text", ""))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_bytes(self.to_bytes())
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Voice":
        path = Path(path)
        if not path.is_file():
            raise InputError(f"voice file {path} not found")
        return cls.from_bytes(path.read_bytes())
