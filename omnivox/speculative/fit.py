"""Does a learned draft fit the Thinker? The one-line refusal (`DraftMismatch`) and the checks
both draft layouts share: a field equal to the Thinker's, and the target layer ids."""
from __future__ import annotations

from typing import Sequence

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
