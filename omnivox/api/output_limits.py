"""How much one request may ask the model to generate (`serve --max-output-tokens`,
`--max-audio-seconds`), and the 400s beyond it.

Both default to what the model's context allows: tokens the Thinker's (S2: the slow AR's)
context, audio the Talker's (S2: the slow AR's) context in frames. Audio limits are given in
seconds and kept in the model's own frames (`ServedModel.frame_rate`: Qwen3-Omni 12.5/s, S2
~21.5/s). An omitted request value takes the checkpoint's default, capped at the limit, so a
request is never cut short without `finish_reason: "length"`.

Two conventions above a limit: OpenAI's HTTP fields (`max_tokens`, `max_completion_tokens`) and
omnivox's own frame fields (`max_audio_frames`, speech `max_frames`) are refused with a 400
(`check_*`); "at most" fields are clamped to the limit (`*_at_most`): the peers' `max_new_tokens`
and `talker_max_new_tokens` (their benchmarks send 2048 whatever the server) and the realtime
session's `max_output_tokens` ("inf" and 4096 are what OpenAI's realtime clients send).
"""
from __future__ import annotations

from dataclasses import dataclass

from omnivox.api.errors import ApiError
from omnivox.errors import OmnivoxError
from omnivox.serving import ChatModel, ServedModel


@dataclass(frozen=True)
class OutputLimits:
    max_tokens: int  # text tokens a reply may ask for (chat max_tokens)
    max_frames: int  # audio frames a reply may ask for (max_audio_frames, speech max_frames)
    frame_rate: float  # frames per second of audio
    context: int  # the Thinker's (S2: slow AR's) context, in tokens
    default_tokens: int  # an omitted max_tokens (before the context left is applied)
    default_frames: int  # an omitted max_frames / max_audio_frames

    @classmethod
    def for_model(cls, model: ServedModel, max_output_tokens: int | None = None,
                  max_audio_seconds: float | None = None) -> "OutputLimits":
        """The limits for a loaded `ServedModel`; None takes the most its context allows.
        A value beyond the context raises OmnivoxError (a bad serve flag)."""
        context, frame_cap, rate = model.max_model_len, model.audio_context_frames, model.frame_rate
        tokens = context if max_output_tokens is None else int(max_output_tokens)
        if tokens > context:
            raise OmnivoxError(f"--max-output-tokens {tokens} exceeds the model's context ({context} tokens)")
        frames = frame_cap if max_audio_seconds is None else int(max_audio_seconds * rate)
        if frames > frame_cap:
            raise OmnivoxError(f"--max-audio-seconds {max_audio_seconds:g} exceeds what the model's context holds "
                               f"({frame_cap} frames, {frame_cap / rate:.1f} s)")
        if max_audio_seconds is not None and frames < 1 <= frame_cap:
            raise OmnivoxError(f"--max-audio-seconds {max_audio_seconds:g} is under one frame ({1 / rate:.3f} s)")
        # the checkpoint's (or family's) defaults for omitted values
        default_tokens = model.default_max_tokens if isinstance(model, ChatModel) else tokens
        return cls(max_tokens=tokens, max_frames=frames, frame_rate=rate, context=context,
                   default_tokens=min(default_tokens, tokens), default_frames=min(model.default_max_frames, frames))

    def seconds(self, frames: int) -> float:
        return frames / self.frame_rate if self.frame_rate else 0.0

    def check_tokens(self, value: int | None, param: str) -> None:
        """A 400 naming `param` when a requested max_tokens exceeds --max-output-tokens."""
        if value is not None and value > self.max_tokens:
            raise ApiError(400, f"{param} is {value}; this server's limit is {self.max_tokens} tokens "
                                "(serve --max-output-tokens)", param=param, code="invalid_value")

    def frames(self, value: int | None, param: str, at_most: bool = False) -> tuple[int, str | None]:
        """(The frames to generate, a note when clamped) for a requested `value` of field `param`:
        the default when omitted; above the limit, the limit and a note saying so where `param` means
        "at most" (`at_most`), else a 400 naming `param`."""
        if value is None:
            return self.default_frames, None
        if value <= self.max_frames:
            return value, None
        what = f"{self.max_frames} frames ({self.seconds(self.max_frames):.1f} s of audio; serve --max-audio-seconds)"
        if at_most:
            return self.max_frames, f"{param} {value} is above this server's limit of {what}: clamped to it"
        raise ApiError(400, f"{param} is {value} frames ({self.seconds(value):.1f} s); this server's limit is {what}",
                       param=param, code="invalid_value")

    def tokens_at_most(self, value: float | None) -> int:
        """An "at most" token count (realtime `max_output_tokens`; math.inf: "inf"): the default
        when omitted, the limit when above it."""
        return self.default_tokens if value is None else int(min(value, self.max_tokens))

    def reply_tokens(self, value: int | None, param: str, prompt_tokens: int) -> int:
        """The tokens a chat reply may generate after a `prompt_tokens`-token prompt: `value`
        (a 400 with code context_length_exceeded when prompt + value exceeds the context), else
        the default capped at the context left."""
        left = self.context - prompt_tokens
        if value is None:
            return max(1, min(self.default_tokens, left))
        if value > left:
            raise ApiError(400, f"the prompt is {prompt_tokens} tokens and {param} is {value}: together "
                                f"{prompt_tokens + value}, over the model's context of {self.context} tokens; "
                                f"lower {param} to at most {left} or shorten the messages",
                           param=param, code="context_length_exceeded")
        return value
