"""Tensor parallelism for the Thinker's text stack: a process group wrapper (`group`), the cuts that
turn a full model into one rank's shard (`shard`), read straight from a checkpoint by
`models.qwen3_omni.weights.load_model(tp=...)`."""
