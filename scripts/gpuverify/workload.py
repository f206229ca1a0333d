"""The Qwen3-Omni requests the engine phases submit (speed, graphs, placement, speculative, TP),
built without an `Omni`: prompts, options, and queueing one through the graph's request factory."""
from __future__ import annotations


def queue_request(engine, prompt, opts):
    """Queue one request: the graph's typed request for `prompt` and `opts`, built here."""
    return engine.submit(engine.stages.new_request(prompt, opts))


def qwen_prompt(ids: list[int]):
    from omnivox.models.qwen3_omni.types import PreparedPrompt
    return PreparedPrompt(ids=list(ids))


def text_options(tokens: int):
    from omnivox.models.qwen3_omni.types import GenerationOptions
    return GenerationOptions(max_tokens=tokens, return_audio=False, ignore_eos=True)


def speech_options(cfg, tokens: int, frames: int):
    """`Omni.options(ChatParams(greedy=True, ignore_eos=True, speaker="ethan"))`, built without an `Omni`."""
    from omnivox.models.qwen3_omni.types import GenerationOptions
    from omnivox.sampling.params import SamplingParams

    speakers = cfg.talker.speaker_id
    return GenerationOptions(
        max_tokens=tokens, max_frames=frames, ignore_eos=True, return_audio=True, seed=0,
        speaker_id=speakers.get("ethan", next(iter(speakers.values()), None)),
        talker=SamplingParams(greedy=True, temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05),
        code_predictor=SamplingParams(greedy=True, temperature=1.0, top_k=50, top_p=0.8))
