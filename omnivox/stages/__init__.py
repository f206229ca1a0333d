"""The stage protocol (`base.Stage`) and its kinds: a paged autoregressive stage driven by a
family's adapter (`ar.PagedARStage`) and a vocoder over a slot-indexed pool of streaming
states (`vocoder.VocoderStage`)."""
