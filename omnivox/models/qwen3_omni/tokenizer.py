"""Text tokenizer and chat template of a Qwen3-Omni checkpoint folder.

The tokenizer is a byte-level BPE read with the `tokenizers` library, from `tokenizer.json` or,
when a folder ships only the slow files, from `vocab.json` + `merges.txt` with Qwen2's
pre-tokenizer. Added tokens declared in `tokenizer_config.json` (`added_tokens_decoder`) are
checked against (or added to) the backend with the ids the file declares. Special token ids are
never hard-coded here: callers take them from the checkpoint's config or `token_to_id`.
"""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from omnivox.errors import CheckpointError

# Qwen2's pre-tokenizer split (the same regex as its slow tokenizer); used only when a folder
# has no tokenizer.json and the backend is rebuilt from vocab.json + merges.txt.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REPLACEMENT = "\ufffd"


class Tokenizer:
    """A checkpoint's text tokenizer: text <-> ids, with special tokens written literally in text."""

    def __init__(self, backend: tokenizers.Tokenizer, special_tokens_map: dict[str, str] | None = None):
        self.backend = backend
        # Named special tokens of tokenizer_config.json (bos_token, eos_token, ...), handed to chat
        # templates as transformers does.
        self.special_tokens_map = dict(special_tokens_map or {})
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self.special_strings = tuple(tok.content for tok in added.values() if tok.special)
        # the same tokenizer with special-token strings read as plain text (see shield.py)
        self._plain = tokenizers.Tokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; literal special tokens such as `<|im_start|>` map to their own ids
        (for trusted text only: user text goes through `shield.Shield` + `encode_pieces`).
        NOTE: `encode_batch` releases the GIL (`encode` does not), so a long text tokenized in a
        worker thread never stalls the server's event loop; the ids are the same."""
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_pieces(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """Ids of a prompt cut into (text, literal) pieces (`Shield.split`): literal pieces are
        encoded as plain text, so a special-token string in them never becomes a control id."""
        ids: list[int] = []
        normal = self.backend.encode_batch([p for p, lit in pieces if not lit], add_special_tokens=False)
        plain = self._plain.encode_batch([p for p, lit in pieces if lit], add_special_tokens=False)
        normal_it, plain_it = iter(normal), iter(plain)
        for _, lit in pieces:
            ids.extend(next(plain_it if lit else normal_it).ids)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Streams text one token at a time.

    Contract: the concatenation of every `push` result followed by `flush()` equals
    `tokenizer.decode(all pushed ids)`. A delta is withheld while the decoded tail ends in an
    incomplete UTF-8 sequence (a byte-level piece of a multi-byte character decodes to U+FFFD);
    it is released by the token that completes it, or by `flush()` at the end of the stream.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: a little already-emitted context for the decoder
        self._read = 0  # ids before this index have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one id; return the newly printable text ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        emitted = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(emitted) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(emitted):]

    def flush(self) -> str:
        """Release whatever is still held back (an incomplete tail decodes to U+FFFD)."""
        emitted = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(emitted):]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e}); restore the file from the checkpoint") from e


def _backend_from_vocab_merges(folder: Path) -> tokenizers.Tokenizer:
    """Qwen2's fast tokenizer rebuilt from the slow files (NFC, regex split, byte-level BPE)."""
    model = BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
    backend = tokenizers.Tokenizer(model)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _apply_added_tokens(backend: tokenizers.Tokenizer, decoder: dict, where: Path) -> None:
    """Make the backend hold every `added_tokens_decoder` entry at its declared id."""
    for key in sorted(decoder, key=int):
        entry = decoder[key] if isinstance(decoder[key], dict) else {"content": str(decoder[key])}
        content, special = entry["content"], bool(entry.get("special", False))
        known = backend.token_to_id(content)
        if known is None or (special and known not in backend.get_added_tokens_decoder()):
            token = AddedToken(content, special=special, normalized=bool(entry.get("normalized", not special)),
                               lstrip=bool(entry.get("lstrip", False)), rstrip=bool(entry.get("rstrip", False)),
                               single_word=bool(entry.get("single_word", False)))
            (backend.add_special_tokens if special else backend.add_tokens)([token])
            known = backend.token_to_id(content)
        if known != int(key):
            raise CheckpointError(
                f"{where}: added token {content!r} is declared with id {key} but the vocabulary gives it "
                f"id {known}; the tokenizer files come from different checkpoints")


def _special_tokens_map(config: dict) -> dict[str, str]:
    out = {}
    for name in _SPECIAL_ATTRS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def load_tokenizer(folder: str | Path) -> Tokenizer | None:
    """The folder's tokenizer, or None when it has no tokenizer files (drive it with ids then)."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{folder / 'tokenizer.json'}: cannot load ({e})") from e
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        backend = _backend_from_vocab_merges(folder)
    else:
        return None
    config_path = folder / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    _apply_added_tokens(backend, config.get("added_tokens_decoder") or {}, config_path)
    return Tokenizer(backend, _special_tokens_map(config))


def _pick_template(value: object, where: Path) -> str | None:
    """A template from its stored form: a string, [{"name", "template"}, ...] or {name: template}."""
    if value is None or isinstance(value, str):
        return value
    named = {}
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    elif isinstance(value, dict):
        named = dict(value)
    if isinstance(named.get("default"), str):
        return named["default"]
    raise CheckpointError(f"{where}: chat_template has no 'default' entry (found {sorted(map(str, named))})")


def load_chat_template(folder: str | Path) -> str | None:
    """The folder's chat template: chat_template.jinja, chat_template.json, then tokenizer_config.json."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = folder / name
        if path.is_file():
            template = _pick_template(_read_json(path).get("chat_template"), path)
            if template is not None:
                return template
    return None
