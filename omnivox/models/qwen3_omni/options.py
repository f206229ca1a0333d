"""Qwen3-Omni's generation options: a request's `ChatParams` -> the engine's `GenerationOptions`,
from the checkpoint's defaults (generation_config.json), its speakers and its tokenizer."""
from __future__ import annotations

from omnivox.errors import InputError
from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
from omnivox.models.qwen3_omni.shield import Shield
from omnivox.models.qwen3_omni.types import GenerationOptions
from omnivox.sampling.params import SamplingParams
from omnivox.serving import ChatParams

MAX_TALKER_INSTRUCTION_CHARS = 4096  # a voice/style note, checked before it is tokenized
MAX_TALKER_INSTRUCTION_TOKENS = 1024  # ... and after (its turn markers included), at most 1/4 of the Talker context


class ChatOptions:
    """The mapping of one checkpoint. Defaults: its generation_config.json, else transformers'
    composite defaults (Thinker greedy; Talker temperature 0.9, top-k 50, penalty 1.05; code
    predictor top-k 50, top-p 0.8)."""

    def __init__(self, cfg: Qwen3OmniConfig, generation_config: dict, tokenizer):
        self.cfg, self.gc, self.tokenizer = cfg, generation_config, tokenizer
        eos = generation_config.get("eos_token_id")  # the ids that end a reply besides im_end
        self.stop_ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        self.max_tokens = int(generation_config.get("max_new_tokens", 1024))
        self.max_frames = (int(generation_config["talker_max_new_tokens"]) - 1
                           if "talker_max_new_tokens" in generation_config else 4095)
        self.speakers = sorted(cfg.talker.speaker_id) if cfg.has_audio_output else []
        # Ethan (the released checkpoint's default speaker) where the checkpoint has him, else its first
        self.default_voice = "ethan" if "ethan" in self.speakers else next(iter(self.speakers), None)
        context = cfg.talker.text.max_position_embeddings if cfg.has_audio_output else 0
        self.max_instruction_tokens = (min(MAX_TALKER_INSTRUCTION_TOKENS, context // 4) if context
                                       else MAX_TALKER_INSTRUCTION_TOKENS)

    def __call__(self, p: ChatParams) -> GenerationOptions:
        gc, greedy = self.gc, p.is_greedy
        sampled = not greedy and (bool(gc.get("do_sample")) or any(
            v is not None for v in (p.temperature, p.top_p, p.top_k)))
        thinker = SamplingParams(
            greedy=not sampled,
            temperature=p.temperature if p.temperature is not None else float(gc.get("temperature", 1.0)),
            top_k=p.top_k if p.top_k is not None else int(gc.get("top_k", 0) or 0),
            top_p=p.top_p if p.top_p is not None else float(gc.get("top_p", 1.0)),
            repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None
            else float(gc.get("repetition_penalty", 1.0)))
        talker = SamplingParams(
            greedy=greedy and not p.talker_sampling,
            temperature=0.9 if p.talker_temperature is None else p.talker_temperature,
            top_k=50 if p.talker_top_k is None else p.talker_top_k,
            top_p=1.0 if p.talker_top_p is None else p.talker_top_p,
            repetition_penalty=1.05 if p.talker_repetition_penalty is None else p.talker_repetition_penalty)
        code_predictor = SamplingParams(greedy=greedy, temperature=1.0, top_k=50, top_p=0.8)
        return GenerationOptions(
            max_tokens=self.max_tokens if p.max_tokens is None else int(p.max_tokens),
            max_frames=self.max_frames if p.max_frames is None else int(p.max_frames),
            thinker=thinker, talker=talker, code_predictor=code_predictor,
            speaker_id=self.speaker_id(p.speaker) if p.return_audio else None,
            return_audio=p.return_audio and self.cfg.has_audio_output, seed=p.seed, stop_token_ids=self.stop_ids,
            talker_instruction_ids=self.instruction_ids(p.talker_instruction), ignore_eos=p.ignore_eos,
            speculative=bool(p.speculative), playing=bool(p.playing))

    def speaker_id(self, speaker: str | None) -> int | None:
        if not self.cfg.has_audio_output:
            return None
        table = self.cfg.talker.speaker_id
        if speaker is None:
            speaker = self.default_voice
            if speaker is None:
                raise InputError("this checkpoint defines no speakers")
        key = str(speaker).lower()
        if key not in table:
            raise InputError(f"unknown speaker {speaker!r}; this model has: {', '.join(sorted(table))}")
        return table[key]

    def instruction_ids(self, instruction: str | None) -> tuple[int, ...]:
        """One whole user turn, encoded as the Talker encodes the prompt's user turns; its text stays
        text (no control tokens) and its length is bounded in tokens too."""
        if not instruction:
            return ()
        if self.tokenizer is None:
            raise InputError("talker_instruction needs the checkpoint's tokenizer")
        if len(instruction) > MAX_TALKER_INSTRUCTION_CHARS:
            raise InputError(f"talker_instruction is {len(instruction)} characters; the limit is "
                             f"{MAX_TALKER_INSTRUCTION_CHARS}", param="talker_instruction", code="input_too_long")
        shield = Shield(self.tokenizer.special_strings)
        ids = tuple(shield.encode(self.tokenizer, f"<|im_start|>user\n{shield.text(instruction)}<|im_end|>\n"))
        if len(ids) > self.max_instruction_tokens:
            raise InputError(f"talker_instruction is {len(ids)} tokens; the limit is "
                             f"{self.max_instruction_tokens}", param="talker_instruction", code="input_too_long")
        return ids
