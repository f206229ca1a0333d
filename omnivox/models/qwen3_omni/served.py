"""Qwen3-Omni served: the serving protocols (`omnivox.serving.ChatModel`) over a loaded checkpoint,
and nothing else. `Qwen3OmniCheckpoint` loads the weights and states the model card's facts;
`Qwen3OmniServed` turns chats, speech and growing prompts into engine requests. The offline verbs
(`generate`, `stream`, `speak`) are `omnivox.offline`'s, over any served model."""
from __future__ import annotations

import warnings
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from omnivox.engine.config import EngineConfig, SpeculativeConfig
from omnivox.engine.engine import Engine
from omnivox.engine.owner import EngineOwner
from omnivox.engine.handle import RequestHandle
from omnivox.engine.placement import Placement
from omnivox.engine.prompt import PromptStream, Segment
from omnivox.errors import ContextTooLong, InputError
from omnivox.media_budget import MediaLimits
from omnivox.models.qwen3_omni.code2wav import SAMPLE_RATE
from omnivox.models.qwen3_omni.conversation import ChatLayout
from omnivox.models.qwen3_omni.family import FAMILY
from omnivox.models.qwen3_omni.media import reply_suppressed_ids
from omnivox.models.qwen3_omni.options import ChatOptions
from omnivox.models.qwen3_omni.processor import Qwen3OmniProcessor, read_generation_config
from omnivox.models.qwen3_omni.shield import Shield
from omnivox.models.qwen3_omni.stages.graph import served_graph
from omnivox.models.qwen3_omni.tp_worker import start_sharded
from omnivox.models.qwen3_omni.types import GenerationOptions
from omnivox.models.qwen3_omni.weights import load_model
from omnivox.parallel.launch import TensorParallel
from omnivox.serving import ChatParams, PreparedChat, SpeechParams, greedy_temperature, stage_weight_bytes

CHAT_FIELDS = frozenset(f.name for f in fields(ChatParams))


class Qwen3OmniCheckpoint:
    """A loaded Qwen3-Omni checkpoint and the facts the server states of it (`ServedModel`'s)."""

    family = FAMILY
    sample_rate = SAMPLE_RATE

    def __init__(self, model: str | Path | None = None, dtype: str = "float32", device: str = "cpu",
                 progress: bool = True, engine_config: EngineConfig | None = None,
                 speculative_config: dict | str | None = None, placement: str | dict | Placement | None = None,
                 tensor_parallel_size: int = 1, quantization: str | None = None, fp8_compute: str = "auto"):
        """`placement`: a device per stage (`thinker`, `talker`, `vocoder`, `encoder`; e.g.
        "thinker=cuda:0,talker=cuda:1"), the others on `device` (engine/placement.py).
        `tensor_parallel_size` N > 1: the Thinker sharded over N processes (this one and N-1
        compute-only workers: omnivox/parallel/), ranks on consecutive devices from the Thinker's.
        `quantization="fp8"`: the Thinker's and Talker's linears and experts and the code predictor
        quantized to block FP8 at load (a checkpoint with an FP8 quantization_config is FP8 without it);
        `fp8_compute`: how FP8 layers compute (`layers.fp8`: "auto", "dequant", "triton")."""
        if model is None:
            from omnivox.models.qwen3_omni.demo import demo_model_path
            model = demo_model_path()
        self.folder = Path(model)
        self.is_demo = (self.folder / "OMNIVOX_DEMO").exists()
        self.placement = Placement.parse(placement, device).check(FAMILY.stages)
        self.tp: TensorParallel | None = None
        if tensor_parallel_size > 1:
            self.tp, self.model = start_sharded(tensor_parallel_size, self.folder, dtype, device, self.placement,
                                                progress, quantization=quantization, fp8_compute=fp8_compute)
        else:
            self.model = load_model(self.folder, dtype=dtype, device=device, progress=progress, placement=self.placement,
                                    quantization=quantization, fp8_compute=fp8_compute)
        self.cfg = self.model.cfg
        self.processor = Qwen3OmniProcessor(self.folder, self.cfg)
        self.generation_config = read_generation_config(self.folder)
        tok = self.processor.tokenizer
        self.chat_options = ChatOptions(self.cfg, self.generation_config, tok)
        self.suppressed_ids = reply_suppressed_ids(self.cfg, tok.special_ids if tok is not None else frozenset(),
                                                   self.chat_options.stop_ids)
        self.engine_config = engine_config or EngineConfig()
        if speculative_config is not None:  # vLLM's keys, e.g. {"method": "ngram", "num_speculative_tokens": 4}
            self.engine_config = replace(self.engine_config, speculative=SpeculativeConfig.parse(speculative_config))
        self.kv_budget = None  # engine/memory.py's KVBudget when registry.load sized the KV from the device

    @property
    def media_limits(self) -> MediaLimits:
        """What one request's media may cost to decode (`serve --max-media-decode-mb`)."""
        return self.processor.limits

    @media_limits.setter
    def media_limits(self, limits: MediaLimits) -> None:
        self.processor.limits = limits

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def speakers(self) -> list[str]:
        return self.chat_options.speakers

    @property
    def default_voice(self) -> str | None:
        return self.chat_options.default_voice

    @property
    def default_max_tokens(self) -> int:
        return self.chat_options.max_tokens

    @property
    def default_max_frames(self) -> int:
        return self.chat_options.max_frames

    @property
    def max_model_len(self) -> int:
        return self.cfg.thinker.text.max_position_embeddings

    @property
    def frame_rate(self) -> float:
        """Talker frames per second of audio (12.5: one frame per 80 ms); 0 for a text-only checkpoint."""
        return self.sample_rate / self.cfg.code2wav.total_upsample if self.cfg.has_audio_output else 0.0

    @property
    def audio_context_frames(self) -> int:
        """The most frames one reply can hold: the Talker's context (one position a frame)."""
        return self.cfg.talker.text.max_position_embeddings if self.cfg.has_audio_output else 0

    @property
    def modalities(self) -> list[str]:
        return ["text", "audio"] if self.cfg.has_audio_output else ["text"]

    @property
    def builtin_voices(self) -> list[str]:
        return self.speakers

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def weight_bytes(self) -> dict[str, dict[str, int]]:
        """This process's weights (a tensor-parallel Thinker: rank 0's shard) by stage and dtype."""
        return stage_weight_bytes(self.model.stage_modules())

    def default_kv_mb(self) -> float:
        return 256.0  # Thinker + Talker, half each

    @property
    def prompt_kv_pages(self) -> int:
        """KV pages of the stage that holds prompts (the Thinker)."""
        from omnivox.models.qwen3_omni.stages.graph import split_kv_budget
        return split_kv_budget(self.model, self.engine_config)[0]

    def kv_summary(self) -> str:
        from omnivox.models.qwen3_omni.stages.graph import split_kv_budget
        thinker, talker = split_kv_budget(self.model, self.engine_config)
        spec = self.engine_config.speculative
        draft = {"dflash": " (each with the DFlash draft's KV)", "eagle3": " (each with the EAGLE-3 head's KV and "
                 "features)"}.get(spec.method if spec is not None else "", "")
        return f"thinker {thinker} pages{draft}" + (f", talker {talker} pages" if talker else "") + \
            f" ({self.engine_config.kv_cache_mb:g} MB)"

    def describe(self) -> list[str]:
        return [f"Qwen3-Omni; context {self.max_model_len} tokens; voices: {', '.join(self.speakers) or '(none: text only)'}"]

    def bench_workload(self, args):
        from omnivox.models.qwen3_omni.bench import QwenWorkload
        return QwenWorkload(self, args)


class Qwen3OmniServed(EngineOwner, Qwen3OmniCheckpoint):
    """Qwen3-Omni as `omnivox.serving.ChatModel`: chats, text to speech and growing (realtime)
    prompts become engine requests; `build_prompt` and `options` are the steps they share."""

    def build_graph(self):
        return served_graph(self, self.engine_config)

    def engine_started(self, engine: Engine) -> None:
        if self.tp is not None:  # a rank that dies stops the engine
            self.tp.on_failure = engine.break_down

    def close(self) -> None:
        """Stop the engine (a later call starts a new one), and the tensor-parallel workers for good."""
        super().close()
        if self.tp is not None:
            self.tp.close()

    def options(self, params: ChatParams = ChatParams()) -> GenerationOptions:
        """The engine's options for `params` (models/qwen3_omni/options.py)."""
        return self.chat_options(params)

    def prepare(self, *args, **kwargs):
        """Deprecated name of `build_prompt` (kept one release)."""
        warnings.warn("Omni.prepare is now Omni.build_prompt; prepare goes in the next release", DeprecationWarning,
                      stacklevel=2)
        return self.build_prompt(*args, **kwargs)

    def build_prompt(self, messages: list[dict] | None = None, *, prompt_ids: list[int] | None = None,
                     audio: list[Any] = (), images: list[Any] = (), videos: list[Any] = (), system: str | None = None):
        """The prompt (token ids, featurised media) of chat `messages`, or of `prompt_ids` with the
        media their placeholders stand for, without running it."""
        if (messages is None) == (prompt_ids is None):
            raise InputError("pass exactly one of messages= or prompt_ids=")
        if messages is not None:
            if audio or images or videos:
                raise InputError("with messages=, put media inside the messages' content parts")
            prompt = self.processor.from_messages(messages, system=system)
        else:
            prompt = self.processor.from_ids(prompt_ids, audio=audio, images=images, videos=videos)
        limit = self.cfg.thinker.text.max_position_embeddings
        if limit and len(prompt.ids) + 1 > limit:
            raise ContextTooLong(f"prompt is {len(prompt.ids)} tokens; the model's context is {limit}")
        return prompt

    def check_speakable(self, prompt, opts: GenerationOptions) -> None:
        """Speech output needs the chat layout: the prompt must end with `<|im_start|>assistant` and
        one more token (the newline), as the Talker's prefill is built from that header."""
        if not opts.return_audio:
            return
        ids, c = prompt.ids, self.cfg
        if len(ids) < 3 or ids[-3] != c.im_start_token_id or ids[-2] != c.assistant_token_id:
            raise InputError("for speech output the prompt must end with the assistant header "
                             "<|im_start|>assistant + newline (chat layout); or request text only")

    # ---- text to speech ---------------------------------------------------------------------
    def check_speech(self, params: SpeechParams) -> None:
        self.options(self._speech_params(params))

    def speech(self, text: str, params: SpeechParams = SpeechParams(), *, voice: Any = None, references: Any = (),
               loop=None, request_id: str | None = None, **options) -> RequestHandle:
        """Text to speech: the Talker voices `text` directly as the assistant's reply (no Thinker
        decoding) in a speaker's voice; the prompt is one user turn holding the same text.
        `options`: `ChatParams` fields that replace what `params` and `voice` give (offline
        callers: `speaker=`, `greedy=`, `talker_*`)."""
        if references:
            raise InputError("references (voice cloning) need a Fish S2 model; this Qwen3-Omni model speaks "
                             f"with its voices: {', '.join(self.speakers)}", param="references",
                             code="voices_unsupported")
        if voice is not None and not isinstance(voice, str):
            raise InputError("saved voices need a Fish S2 model", param="voice", code="voices_unsupported")
        name = voice or "default"
        if name != "default" and name.lower() not in self.speakers:
            raise InputError(f"unknown voice {name!r:.80}; this model's voices are: default, "
                             f"{', '.join(self.speakers)}", param="voice", code="invalid_voice")
        unknown = sorted(set(options) - CHAT_FIELDS)
        if unknown:
            raise InputError(f"unknown Qwen3-Omni speech option(s): {', '.join(unknown)}")
        chat = replace(self._speech_params(params, None if name == "default" else name.lower()), **options)
        if not self.cfg.has_audio_output:
            raise InputError("this checkpoint has no Talker (enable_audio_output is false)")
        if self.tokenizer is None:
            raise InputError("text to speech needs the checkpoint's tokenizer")
        if not isinstance(text, str) or not text.strip():
            raise InputError("input text is empty")
        shield = Shield(self.tokenizer.special_strings)  # the text is voiced as written
        ids = tuple(shield.encode(self.tokenizer, shield.text(text)))
        opts = replace(self.options(chat), speech_ids=ids)
        prompt = self.build_prompt([{"role": "user", "content": text}])
        self.check_speakable(prompt, opts)
        return self.engine.submit(self.engine.stages.new_request(prompt, opts, request_id=request_id), loop=loop)

    @staticmethod
    def _speech_params(params: SpeechParams, speaker: str | None = None) -> ChatParams:
        """The Talker's sampling: a temperature below 1e-5 (0 included) = greedy (the other sampling
        fields then unused); `instructions` = a Talker-only style note (talker_instruction)."""
        p, greedy = params, greedy_temperature(params.temperature)
        return ChatParams(speaker=speaker, seed=p.seed, max_frames=p.max_frames, greedy=greedy,
                          talker_temperature=None if greedy else p.temperature,
                          talker_top_p=None if greedy else p.top_p, talker_top_k=None if greedy else p.top_k,
                          talker_repetition_penalty=None if greedy else p.repetition_penalty,
                          talker_instruction=p.instructions or None, playing=p.playing)

    # ---- chat ---------------------------------------------------------------------------------
    def check_chat(self, params: ChatParams) -> None:
        self.options(params)

    def prepare_chat(self, messages: list[dict] | None, params: ChatParams, **prompt) -> PreparedChat:
        """`prompt`: `build_prompt`'s keywords (`prompt_ids=` with `audio=`, `images=`, `videos=`; `system=`)."""
        opts = self.options(params)
        built = self.build_prompt(messages, **prompt)
        self.check_speakable(built, opts)
        return PreparedChat(built, opts, len(built.ids), len(opts.talker_instruction_ids))

    def submit_chat(self, request: PreparedChat, *, max_tokens: int | None = None, text_hook=None, loop=None,
                    request_id: str | None = None) -> RequestHandle:
        if text_hook is not None and self.tokenizer is None:
            raise InputError("a text hook needs the checkpoint's tokenizer (to re-tokenize what it returns)")
        opts = request.options if max_tokens is None else replace(request.options, max_tokens=max_tokens)
        req = self.engine.stages.new_request(request.prompt, opts, request_id=request_id, hook=text_hook)
        return self.engine.submit(req, loop=loop)

    def open_prompt(self, prompt_ids: list[int], params: ChatParams, *, segments: list[Segment] = (), loop=None,
                    request_id: str | None = None) -> tuple[RequestHandle, PromptStream]:
        """A request whose prompt keeps growing (realtime input): `prompt_ids` now, then
        `stream.append(ids, embeds=rows)` as the user speaks (e.g. audio rows encoded as they
        arrive) and `stream.close(tail_ids)` at the end of the turn. The Thinker prefills what has
        arrived at every step and answers once the stream is closed; for speech output the closed
        prompt must end with the assistant header. A segment may carry host audio instead of rows
        (`Segment.audio`): the request's encoder stage encodes it. `segments` are in the stream
        before the engine sees the request, so the prefix cache matches them at admission (a conversation's earlier
        turns: their audio rows with the same `keys` as when they were first appended)."""
        opts = self.options(params)
        prompt = self.processor.from_ids(prompt_ids)
        if prompt.audio_features or prompt.visual:
            raise InputError("the fixed part of a streamed prompt is text; stream the media rows")
        stream = PromptStream(wake=self.engine.wake)
        stream.extend(list(segments))
        req = self.engine.stages.new_request(prompt, opts, request_id=request_id, stream=stream)
        return self.engine.submit(req, loop=loop), stream

    def conversation_layout(self) -> ChatLayout:
        return ChatLayout(self.tokenizer, self.cfg)

    def audio_window(self, window_seconds: float):
        """The AuT's window of about `window_seconds` as host arithmetic (realtime input: the
        listening request's encoder stage encodes the host audio; rows come out as each window
        completes)."""
        from omnivox.models.qwen3_omni.audio_stream import AudioWindow, window_chunks_for
        a = self.cfg.thinker.audio
        return AudioWindow(window_chunks_for(window_seconds, a), 2 * a.n_window)
