"""The stage kinds (the protocol they implement: `engine.stage.Stage`): a paged autoregressive
stage driven by a family's adapter (`ar.PagedARStage`; the adapter's halves: `admission.ARAdmission`,
the request's lifecycle, and `step.ARStep`, the step over a `step.StepBatch`) and a vocoder over a
slot-indexed pool of streaming states (`vocoder.VocoderStage`). What a chat family's stage shares:
the admission of streamed prompts (`streamed_prompt.StreamedPromptAdmission`) and each request's
generated text (`text_stream.TextStream`: detokenizing, stop rules, the text hook, voiced ids);
a speech stage's frames (`frames.SpeechARAdapter`). The encoder stage (`encoder.EncoderStage`)
is the front of a listening request's route: host audio in its prompt stream, rows out to the
prompt stage, step by step while the stream is open."""
