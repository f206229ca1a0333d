"""The stage kinds (the protocol they implement: `engine.stage.Stage`): a paged autoregressive
stage driven by a family's adapter (`ar.PagedARStage`; the adapter's halves: `admission.ARAdmission`,
the request's lifecycle, and `step.ARStep`, the step over a `step.StepBatch`) and a vocoder over a
slot-indexed pool of streaming states (`vocoder.VocoderStage`)."""
