"""Saved voices (reference cloning: a `VoiceCloner`, S2): a folder of `<name>.voice` files and the
`/v1/audio/voices` routes.

A voice's id is its name: 1-64 characters of `A-Z a-z 0-9 _ -` (no dots, slashes or anything
else, so a name can never leave the folder; `default` is reserved). A file holds the bytes the
model wrote (`VoiceCloner.voice_to_bytes`; the store never reads them); a small JSON sidecar
`<name>.json` keeps the consent id and creation time.

One folder may serve several servers (a shared disk): the folder is the whole store, read afresh
on every call (no copy in memory to go stale). A voice is written to a temporary file, then
hard-linked to `<name>.voice`: the link fails if the name exists (EEXIST: 409), so of two servers
creating one name exactly one wins, and a reader never sees half a file. --max-voices is counted
under an exclusive `flock` of `<folder>/.lock`, held only around the count and the link.

`POST /v1/audio/voices` is multipart, as `client.audio.voices.create(name=, audio_sample=,
consent=)` sends it; the sample's transcript is the extra form field `transcript`
(`extra_body={"transcript": ...}`), or the peers' spellings of it, `ref_text` (vLLM-Omni,
SGLang-Omni) and `text` (omnivox's inline references); vLLM-Omni's `speaker_description` is kept
with the voice and shown in its card. Limits: the sample's size (413) and the number of voices (409).
"""
from __future__ import annotations

import contextlib
import email
import email.policy
import errno
import fcntl
import json
import os
import re
import tempfile
import time
from pathlib import Path

from fastapi import Request

from omnivox.api.errors import ApiError
from omnivox.errors import InputError
from omnivox.serving import VoiceCloner

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
RESERVED = ("default",)
SUFFIX = ".voice"
MAX_TRANSCRIPT_CHARS = 4096


def check_name(name: object, param: str = "name") -> str:
    """`name` if it is a safe voice name, else a 400 that says what a name may hold."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        shown = repr(name)[:80] if isinstance(name, str) else type(name).__name__
        raise ApiError(400, f"invalid voice name {shown}: use 1-64 characters of letters, digits, '_' and '-'",
                       param=param, code="invalid_voice_name")
    return name


class VoiceStore:
    def __init__(self, folder: Path, *, max_voices: int = 100, max_sample_bytes: int = 10 * 2**20):
        self.folder, self.max_voices, self.max_sample_bytes = Path(folder), max_voices, max_sample_bytes
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        return self.folder / (check_name(name) + SUFFIX)

    def names(self) -> list[str]:
        return sorted(p.name[:-len(SUFFIX)] for p in self.folder.glob("*" + SUFFIX)
                      if NAME_RE.fullmatch(p.name[:-len(SUFFIX)]))

    def card(self, name: str) -> dict:
        return self._card(name, self._meta(name))

    def _card(self, name: str, meta: dict) -> dict:
        created = meta.get("created_at")
        if not isinstance(created, int):  # its sidecar is not written yet (or lost): the file's time
            try:
                created = int(self._path(name).stat().st_mtime)
            except OSError:  # deleted by another server meanwhile
                created = 0
        card = {"id": name, "object": "audio.voice", "name": name, "type": "audio_sample", "created_at": created}
        if isinstance(meta.get("speaker_description"), str):
            card["speaker_description"] = meta["speaker_description"]
        return card

    def _meta(self, name: str) -> dict:
        try:
            meta = json.loads((self.folder / f"{name}.json").read_text())
            return meta if isinstance(meta, dict) else {}
        except (OSError, ValueError):
            return {}

    def load(self, name: str, param: str = "voice") -> bytes:
        """The saved voice's bytes (for the model's `voice_from_bytes`)."""
        path = self.folder / (check_name(name, param) + SUFFIX)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError):  # never saved, or deleted by another server meanwhile
            raise ApiError(404, f"voice {name!r} not found; see GET /v1/audio/voices", param=param,
                           code="voice_not_found") from None

    def save(self, name: str, data: bytes, consent: str, description: str | None = None) -> dict:
        """Save a voice's bytes (`VoiceCloner.voice_to_bytes`) under a new name."""
        check_name(name)
        if name.lower() in RESERVED:
            raise ApiError(400, f"voice name {name!r} is reserved", param="name", code="invalid_voice_name")
        tmp = _write_temp(self.folder, data)
        try:
            with self._counting():
                if self._path(name).exists():
                    raise self._exists(name)
                if len(self.names()) >= self.max_voices:
                    raise ApiError(409, f"this server keeps at most {self.max_voices} voices (--max-voices); "
                                        "delete one first", code="voice_limit_reached")
                try:
                    os.link(tmp, self._path(name))  # atomic and exclusive, across processes
                except FileExistsError:  # created by a process that does not take the lock
                    raise self._exists(name) from None
        finally:
            tmp.unlink(missing_ok=True)
        meta = {"created_at": int(time.time()), "consent": consent}
        if description:
            meta["speaker_description"] = description
        _write_atomic(self.folder / f"{name}.json", json.dumps(meta).encode())  # after the name is ours
        return self._card(name, meta)

    @staticmethod
    def _exists(name: str) -> ApiError:
        return ApiError(409, f"voice {name!r} already exists; delete it first (DELETE /v1/audio/voices/{name})",
                        param="name", code="voice_exists")

    def delete(self, name: str) -> dict:
        path = self.folder / (check_name(name, "voice_id") + SUFFIX)
        if not path.is_file():
            raise ApiError(404, f"voice {name!r} not found", param="voice_id", code="voice_not_found")
        # the sidecar first: a server creating this name again once the voice is gone writes its own
        (self.folder / f"{name}.json").unlink(missing_ok=True)
        try:
            path.unlink()
        except FileNotFoundError:  # another server deleted it meanwhile
            raise ApiError(404, f"voice {name!r} not found", param="voice_id", code="voice_not_found") from None
        return {"id": name, "object": "audio.voice.deleted", "deleted": True}

    @contextlib.contextmanager
    def _counting(self):
        """Holds the folder's lock: one creation at a time counts the voices, across processes
        (each call opens its own descriptor, so threads of one process exclude each other too).
        NOTE: a shared disk without locks (ENOLCK) is refused with a clear 500, never unlocked."""
        with open(self.folder / ".lock", "ab") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX)
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                raise ApiError(500, f"the voices folder {self.folder} cannot be locked ({e.strerror}): "
                                    "put --voices-dir on a file system with locks") from None
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _write_temp(folder: Path, data: bytes) -> Path:
    """`data` in a new hidden temporary file of `folder` (never listed as a voice)."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = _write_temp(path.parent, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---- HTTP ------------------------------------------------------------------------------------
MAX_PARTS = 16  # the voice form has 5 fields; a body of thousands of parts is refused unparsed


def parse_multipart(content_type: str, body: bytes) -> tuple[dict[str, str], dict[str, bytes]]:
    """(text fields, file fields) of a multipart/form-data body (stdlib parser; no extra dependency).
    NOTE: slow for many parts: the part count is checked first (a byte scan), and callers run
    this in a worker thread, never on the event loop."""
    if not content_type.lower().startswith("multipart/form-data") or "boundary=" not in content_type:
        raise ApiError(400, "send the voice as multipart/form-data (fields name, consent, transcript and the "
                            "file audio_sample)", code="invalid_content_type")
    boundary = content_type.split("boundary=", 1)[1].split(";", 1)[0].strip().strip('"')
    parts = body.count(b"--" + boundary.encode("latin-1")) - 1 if boundary else 0
    if parts > MAX_PARTS:
        raise ApiError(400, f"multipart body has {parts} parts; a voice takes at most {MAX_PARTS}",
                       code="invalid_multipart")
    msg = email.message_from_bytes(b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body,
                                   policy=email.policy.HTTP)
    if not msg.is_multipart():
        raise ApiError(400, "malformed multipart body", code="invalid_multipart")
    fields: dict[str, str] = {}
    files: dict[str, bytes] = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        data = part.get_payload(decode=True) or b""
        if not isinstance(name, str):
            continue
        if part.get_filename() is not None:
            files[name] = data
        else:
            try:
                fields[name] = data.decode("utf-8")
            except UnicodeDecodeError:
                raise ApiError(400, f"form field {name!r} is not UTF-8 text", param=name) from None
    return fields, files


TRANSCRIPT_FIELDS = ("transcript", "ref_text", "text")  # omnivox's, the peers', omnivox's inline references'


def _transcript(fields: dict[str, str]) -> str | None:
    """The sample's transcript under any of its names; several that disagree are a 400."""
    given = {k: fields[k] for k in TRANSCRIPT_FIELDS if k in fields}
    if len(set(given.values())) > 1:
        raise ApiError(400, f"{' and '.join(given)} disagree; send the transcript once", param="transcript",
                       code="invalid_value")
    return next(iter(given.values()), None)


class VoiceService:
    """The /v1/audio/voices handlers. `model` is None on a model without cloning."""

    def __init__(self, store: VoiceStore | None, model: VoiceCloner | None, pool, model_label: str):
        """`pool`: the voice pool (`admission.WorkPool`): parsing and encoding samples run there."""
        self.store, self.model, self.pool, self.model_label = store, model, pool, model_label

    def _need_store(self) -> VoiceStore:
        if self.store is None:
            raise ApiError(400, f"{self.model_label} has no voice cloning: saved voices need a Fish S2 model; "
                                "use one of its built-in voices (GET /v1/models)", code="voices_unsupported")
        return self.store

    async def create(self, request: Request) -> dict:
        store = self._need_store()
        body = await request.body()
        fields, files = await self.pool.run(parse_multipart, request.headers.get("content-type", ""), body)
        kind = fields.get("type", "audio_sample")
        if kind != "audio_sample":
            raise ApiError(400, f"voice type {kind!r} is not supported; only audio_sample", param="type")
        name = check_name(fields.get("name"))
        consent = fields.get("consent", "").strip()
        if not consent:
            raise ApiError(400, "consent is required (the consent recording id)", param="consent")
        transcript = _transcript(fields)
        if transcript is None or not transcript.strip():
            raise ApiError(400, "the sample's transcript is required: send the extra form field `transcript` "
                                "(or `ref_text` / `text`; openai client: extra_body={\"transcript\": ...})",
                           param="transcript")
        if len(transcript) > MAX_TRANSCRIPT_CHARS:
            raise ApiError(400, f"transcript is {len(transcript)} characters; the limit is {MAX_TRANSCRIPT_CHARS}",
                           param="transcript")
        sample = files.get("audio_sample")
        if not sample:
            raise ApiError(400, "audio_sample (a wav/flac/ogg file) is required", param="audio_sample")
        if len(sample) > store.max_sample_bytes:
            raise ApiError(413, f"audio_sample is {len(sample)} bytes; the limit is {store.max_sample_bytes} "
                                "(omnivox serve --max-voice-sample-mb)", param="audio_sample",
                           code="request_too_large")
        description = fields.get("speaker_description")
        if description is not None and len(description) > MAX_TRANSCRIPT_CHARS:
            raise ApiError(400, f"speaker_description is {len(description)} characters; the limit is "
                                f"{MAX_TRANSCRIPT_CHARS}", param="speaker_description")
        return await self.pool.run(self._encode_and_save, store, name, sample, transcript, consent, description)

    def _encode_and_save(self, store: VoiceStore, name: str, sample: bytes, transcript: str, consent: str,
                         description: str | None) -> dict:  # worker thread: saving may wait on the folder's lock
        try:
            voice = self.model.encode_voice(sample, transcript)
        except InputError as e:
            raise ApiError(400, f"audio_sample: {e}", param="audio_sample", code="invalid_audio") from None
        return store.save(name, self.model.voice_to_bytes(voice), consent, description)

    def list(self) -> dict:
        """Saved voices (an empty list on a model without cloning)."""
        store = self.store
        return {"object": "list", "data": [store.card(n) for n in store.names()] if store else []}

    def delete(self, voice_id: str) -> dict:
        return self._need_store().delete(voice_id)
