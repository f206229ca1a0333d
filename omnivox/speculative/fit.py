"""Does a learned draft fit the Thinker? The one-line refusal (`DraftMismatch`) and what both
draft kinds share: reading a draft folder, a field equal to the Thinker's, the target layer ids."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file

from omnivox.errors import CheckpointError


class DraftMismatch(CheckpointError, ValueError):
    """A draft that cannot serve this Thinker (or a config omnivox cannot run): one line, printed as
    `error: ...` by the CLI."""


def check_same(names: Sequence[str], draft, thinker) -> None:
    """Each named field of the draft's config equals the Thinker's text config's, else one line
    naming the field, the draft's value and the Thinker's."""
    for name in names:
        mine, theirs = getattr(draft, name), getattr(thinker, name)
        if mine != theirs:
            raise DraftMismatch(f"draft {name} is {mine} but the Thinker's is {theirs}")


def check_layer_ids(field: str, ids: Sequence[int], layers: int) -> None:
    """Target layer ids (outputs of the Thinker's layers `ids`) are given, in 0..layers-1 and
    increasing, else one line naming `field`, its value and the Thinker's layers."""
    ids = list(ids)
    if not ids or any(not 0 <= i < layers for i in ids):
        raise DraftMismatch(f"draft {field} is {ids} but the Thinker's layers are 0..{layers - 1}")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise DraftMismatch(f"draft {field} is {ids}, not increasing (the Thinker's layers are 0..{layers - 1})")


@contextmanager
def config_fields():
    """Around building a config from config.json's dict: a missing or malformed field becomes one
    DraftMismatch line."""
    try:
        yield
    except DraftMismatch:
        raise
    except KeyError as e:
        raise DraftMismatch(f"draft config: {e.args[0]} is missing") from None
    except (TypeError, ValueError) as e:
        raise DraftMismatch(f"draft config: {e}") from None


def read_config(folder: Path) -> dict:
    """A draft folder's config.json as a dict (refused when there is none)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise DraftMismatch(f"draft model {folder}: no config.json there")
    return json.loads(path.read_text())


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a draft folder's *.safetensors files (refused when there are none)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise DraftMismatch(f"draft model {folder}: no .safetensors weights there")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def refuse_leftovers(folder: Path, missing: Sequence[str], unexpected: Sequence[str]) -> None:
    """A `load_state_dict(strict=False)` that left weights missing or unused is refused."""
    if missing or unexpected:
        raise DraftMismatch(f"draft weights in {folder}: missing {sorted(missing)[:4]}, unexpected "
                            f"{sorted(unexpected)[:4]}")
