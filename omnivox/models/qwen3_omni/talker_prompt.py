"""What the Talker reads: its prefill rows and its per-frame text inputs (spec 8.2-8.4).

Prefill = the user turns of the prompt (system turns and earlier assistant turns dropped;
media pads through `hidden_projection` of the Thinker's accept-layer hidden states, every
other token through `text_projection` of its word embedding) + 9 assistant rows. Frame s
then adds the projected embedding of Thinker token g_{s+1}, `tts_eos` in place of the final
token, and `tts_pad` once the text is used up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from omnivox.engine.placement import hand_over
from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
from omnivox.models.qwen3_omni.model import Qwen3OmniModel


@dataclass
class TalkerPrefill:
    embeds: torch.Tensor  # [L, H_talker]
    input_ids: list[int]  # thinker ids of the user segments + 9 x tts_pad (for positions only)
    user_spans: list[tuple[int, int]]  # [start, end) prompt index ranges that were kept


def segments(ids: list[int], cfg: Qwen3OmniConfig) -> list[tuple[int, int, int | None]]:
    """(start, end, role id) for each `<|im_start|>` segment; tokens before the first are role None."""
    starts = [i for i, t in enumerate(ids) if t == cfg.im_start_token_id]
    out = []
    if not starts or starts[0] > 0:
        out.append((0, starts[0] if starts else len(ids), None))
    for n, s in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(ids)
        out.append((s, end, ids[s + 1] if s + 1 < len(ids) else None))
    return out


class TalkerInputs:
    """Builds Talker inputs for one request from Thinker outputs. The two crossings from the
    Thinker's device to the Talker's (`hand_over`): word-embedding rows of ids, and accept-layer
    hidden rows at media positions."""

    def __init__(self, model: Qwen3OmniModel):
        self.model, self.cfg = model, model.cfg
        self.source = model.device_of("thinker")  # where the Thinker's rows are
        self.device = model.device_of("talker")
        self._special: dict[int, torch.Tensor] = {}

    def project_text(self, ids: list[int]) -> torch.Tensor:
        """TP(E(ids)): the Thinker's word embeddings of `ids`, handed over, through the Talker's
        text_projection -> [N, H_talker]."""
        embed = self.model.thinker.model.embed_tokens
        rows = hand_over(lambda: embed(torch.tensor(ids, device=self.source)), self.device, static_on=self.source)
        return self.model.talker.text_projection(rows)

    def project_hidden(self, hidden: torch.Tensor, at: list[int]) -> torch.Tensor:
        """HP(hidden[at]): accept-layer rows (on the Thinker's device), handed over, through the
        Talker's hidden_projection -> [len(at), H_talker]."""
        rows = hand_over(lambda: hidden.index_select(0, torch.tensor(at, device=hidden.device)), self.device)
        return self.model.talker.hidden_projection(rows)

    def special(self, token_id: int) -> torch.Tensor:
        if token_id not in self._special:
            self._special[token_id] = self.project_text([token_id])[0]
        return self._special[token_id]

    def layout(self, prompt_ids: list[int], instruction_ids: tuple[int, ...] = ()) -> tuple[list[int], list[tuple[int, int]]]:
        """(the Talker's prefill ids: kept user turns + the instruction + 9 x tts_pad, for positions
        only; the kept [start, end) user spans). Host-side; checks the chat layout."""
        cfg = self.cfg
        segs = segments(prompt_ids, cfg)
        if not segs or segs[-1][2] != cfg.assistant_token_id:
            raise ValueError("the prompt must end with an assistant turn header (<|im_start|>assistant\\n)")
        if len(prompt_ids) - segs[-1][0] != 3:
            raise ValueError("the assistant turn must hold exactly <|im_start|>, the role word and a newline")
        user = [(s, e) for s, e, role in segs if role == cfg.user_token_id]
        kept = [t for s, e in user for t in prompt_ids[s:e]] + list(instruction_ids)
        return kept + [cfg.tts_pad_token_id] * 9, user

    def prefill(self, prompt_ids: list[int], accept_hidden: torch.Tensor | None, first_token: int,
                speaker_id: int, instruction_ids: tuple[int, ...] = ()) -> TalkerPrefill:
        """accept_hidden [P, H_thinker]: hidden_states[accept_hidden_layer] at the prompt positions
        (read only at media positions: None for a prompt without media).

        `instruction_ids` (a Talker-only instruction: voice, speaking style), already a whole
        user turn `<|im_start|>user\n ... <|im_end|>\n`, enter after the prompt's user
        turns, encoded like them, in the Talker's prefill only. Reads nothing from the device."""
        cfg, th = self.cfg, self.cfg.thinker
        input_ids, user = self.layout(prompt_ids, instruction_ids)
        a_start = len(prompt_ids) - 3
        rows: list[torch.Tensor] = []
        media = {th.audio_token_id, th.image_token_id, th.video_token_id}
        for s, e in user:
            text = self.project_text(prompt_ids[s:e])
            at = [j for j, t in enumerate(prompt_ids[s:e]) if t in media]
            if at:
                idx = torch.tensor(at, device=self.device)
                text = text.index_copy(0, idx, self.project_hidden(accept_hidden[s:e], at).to(text.dtype))
            rows.append(text)
        if instruction_ids:
            rows.append(self.project_text(list(instruction_ids)))
        tk = cfg.talker
        emb = self.model.talker.model.codec_embedding
        a = self.project_text(prompt_ids[a_start:] + [first_token])  # A_0..A_3
        text_side = torch.stack([a[0], a[1], a[2]] + [self.special(cfg.tts_pad_token_id)] * 4
                                + [self.special(cfg.tts_bos_token_id), a[3]])
        codec_ids = torch.tensor([tk.codec_nothink_id, tk.codec_think_bos_id, tk.codec_think_eos_id, speaker_id,
                                  tk.codec_pad_id, tk.codec_bos_id], device=self.device)
        codec_side = torch.cat([torch.zeros(3, a.shape[-1], dtype=a.dtype, device=self.device), emb(codec_ids)])
        rows.append(text_side + codec_side)
        return TalkerPrefill(torch.cat(rows), input_ids, user)

    def frame_text(self, next_token: int | None, is_final: bool) -> torch.Tensor:
        """Text input for a frame: TP(E(g_{s+1})), tts_eos for the final token, tts_pad after."""
        if next_token is None:
            return self.special(self.cfg.tts_pad_token_id)
        if is_final:
            return self.special(self.cfg.tts_eos_token_id)
        return self.project_text([next_token])[0]
