"""Qwen3-Omni's stage graph: encoder -> Thinker -> Talker (with the code predictor) -> vocoder.

Routes: a text reply passes the Thinker only; a spoken reply the Thinker, Talker and vocoder; a
listening request (a prompt stream: realtime input) starts at the encoder, which encodes the host
audio appended to the stream into the Thinker's input (`stages/encoder.py`); text to speech
(`GenerationOptions.speech_ids`) the Talker and the vocoder: the Talker voices the given ids as
the assistant's reply, and no Thinker runs.
"""
from __future__ import annotations

from omnivox.engine.config import EngineConfig
from omnivox.engine.graph import StageGraph
from omnivox.engine.prompt import PromptStream
from omnivox.engine.request import FrameStream
from omnivox.errors import InputError
from omnivox.kv_cache.pool import KVPool
from omnivox.models.qwen3_omni.demo import DEMO_VERSION
from omnivox.models.qwen3_omni.audio_stream import AudioStreamBatch
from omnivox.models.qwen3_omni.model import Qwen3OmniModel
from omnivox.models.qwen3_omni.sharding import local_kv_heads
from omnivox.models.qwen3_omni.stages.request import QwenRequest, VoicedText
from omnivox.models.qwen3_omni.stages.talker import TalkerAdapter
from omnivox.models.qwen3_omni.stages.thinker import ThinkerAdapter
from omnivox.models.qwen3_omni.stages.vocoder import Code2WavAdapter
from omnivox.models.qwen3_omni.types import GenerationOptions, PreparedPrompt
from omnivox.parallel.launch import TensorParallel, TPSetup
from omnivox.sampling import noise
from omnivox.speculative.methods import draft_page_bytes, make_drafter
from omnivox.stages.ar import PagedARStage
from omnivox.stages.encoder import EncoderStage
from omnivox.stages.text_stream import TextHook
from omnivox.stages.vocoder import VocoderStage


def split_kv_budget(model: Qwen3OmniModel, cfg: EngineConfig) -> tuple[int, int]:
    """KV pages for (Thinker, Talker): `kv_stage_mb` when given, else half of `kv_cache_mb` each.
    Half the bytes each holds about as many spoken replies in both pools: a reply's Talker
    positions (12.5 frames a second of speech) outnumber its Thinker positions (~3 text tokens a
    second) about as much as a Thinker position's KV outweighs a Talker's (released model: 96 vs
    20 KiB). A text-only model gives the Thinker all of it. A learned draft's KV lives in the
    Thinker's pages (`speculative/dflash/drafter.py`, `speculative/eagle3/drafter.py`): a Thinker page costs its bytes too. With tensor parallelism the budget is
    each rank's: a rank's Thinker pool holds its own KV heads only (more pages for the same MB)."""
    th = model.cfg.thinker.text
    dtype = model.thinker.lm_head.weight.dtype
    per_th = KVPool.bytes_per_block(th.num_hidden_layers, cfg.block_size, local_kv_heads(model), th.head_dim, dtype)
    per_th += draft_page_bytes(cfg.speculative, cfg.block_size, dtype)  # a learned draft's KV shares its pages
    given = dict(cfg.kv_stage_mb)
    if not model.cfg.has_audio_output:
        return max(1, int(given.get("thinker", cfg.kv_cache_mb) * 2**20 // per_th)), 0
    tk = model.cfg.talker.text
    per_tk = KVPool.bytes_per_block(tk.num_hidden_layers, cfg.block_size, tk.num_key_value_heads, tk.head_dim, dtype)
    th_mb, tk_mb = (given["thinker"], given["talker"]) if given else (cfg.kv_cache_mb / 2, cfg.kv_cache_mb / 2)
    return max(1, int(th_mb * 2**20 // per_th)), max(1, int(tk_mb * 2**20 // per_tk))


def thinker_pool(model: Qwen3OmniModel, blocks: int, cfg: EngineConfig) -> KVPool:
    """The Thinker's pool on its device: this rank's KV heads (a TP worker builds the same one)."""
    th, w = model.cfg.thinker.text, model.thinker.lm_head.weight
    return KVPool(th.num_hidden_layers, blocks, cfg.block_size, local_kv_heads(model), th.head_dim, w.dtype, w.device)


def _pool(stack_cfg, blocks: int, cfg: EngineConfig, weight) -> KVPool:
    """A stage's pool, on its weights' device."""
    return KVPool(stack_cfg.num_hidden_layers, blocks, cfg.block_size, stack_cfg.num_key_value_heads,
                  stack_cfg.head_dim, weight.dtype, weight.device)


def build(model: Qwen3OmniModel, cfg: EngineConfig, tokenizer=None, suppressed_ids: list[int] = (),
          tp: TensorParallel | None = None) -> StageGraph:
    """`suppressed_ids`: what the Thinker never samples (media.reply_suppressed_ids); `tp`: the
    tensor-parallel ranks that compute the Thinker's steps with this process (they mirror its
    stage: told its pages and sampling rules here)."""
    mcfg = model.cfg
    th_blocks, tk_blocks = split_kv_budget(model, cfg)
    if tp is not None:
        tp.setup(TPSetup(cfg, list(suppressed_ids), th_blocks))
    drafter = make_drafter(cfg.speculative, model, DEMO_VERSION)
    if drafter is not None:
        drafter.bind_pages(th_blocks, cfg.block_size)
    stages = [EncoderStage(AudioStreamBatch(model.thinker.audio_tower)),
              PagedARStage("thinker", ThinkerAdapter(model, cfg, tokenizer, suppressed_ids, drafter),
                           thinker_pool(model, th_blocks, cfg), cfg, mirror=tp)]
    if drafter is not None:  # /metrics: the method, the draft's own KV
        stages[1].batch_stats.draft_method, stages[1].batch_stats.draft_kv_bytes = drafter.method, drafter.kv_bytes()
    if mcfg.has_audio_output:
        stages += [PagedARStage("talker", TalkerAdapter(model, cfg),
                                _pool(mcfg.talker.text, tk_blocks, cfg, model.talker.codec_head.weight), cfg),
                   VocoderStage(Code2WavAdapter(model, tokenizer), cfg)]
    groups = mcfg.talker.num_code_groups if mcfg.has_audio_output else 0
    media = {mcfg.thinker.audio_token_id, mcfg.thinker.image_token_id, mcfg.thinker.video_token_id}

    def make_request(prompt: PreparedPrompt, opts: GenerationOptions, *, hook: TextHook | None = None,
                     stream: PromptStream | None = None, **fields) -> QwenRequest:
        """The graph's `RequestFactory`: `hook` rewrites the Thinker's text before the Talker voices
        it; `stream` is the tail of a prompt that grows while it runs (realtime input)."""
        req = QwenRequest(**fields, frames=FrameStream(groups), prompt=prompt, opts=opts, hook=hook, stream=stream,
                          seed=noise.draw_seed() if opts.seed is None else opts.seed)
        speaks = opts.return_audio and mcfg.has_audio_output
        if opts.speech_ids:
            if not speaks:
                raise InputError("text to speech needs a checkpoint with a Talker")
            if stream is not None or any(t in media for t in prompt.ids):
                raise InputError("text-to-speech prompts carry no media")
            req.route = ("talker", "vocoder")
            req.voiced = VoicedText(ids=[*opts.speech_ids, mcfg.im_end_token_id], final=True,
                                    hidden_done=len(prompt.ids))
            req.text_ids, req.finish_reason, req.text_done_time = list(opts.speech_ids), "stop", req.arrival
        else:
            req.route = ("thinker", "talker", "vocoder") if speaks else ("thinker",)
            if stream is not None:  # listening: the encoder turns the stream's audio into the Thinker's rows
                req.route, req.encoded = ("encoder", *req.route), PromptStream()
        req.playing = opts.playing and speaks
        return req

    return StageGraph(stages, make_request)


def served_graph(omni, cfg: EngineConfig) -> StageGraph:
    """A loaded model's stages under `cfg` (its engine's, and the family's `graph`: the profiling run's copy; its
    tensor-parallel ranks mirror them until the engine's own stages are set up)."""
    return build(omni.model, cfg, omni.tokenizer, omni.suppressed_ids, tp=omni.tp)
