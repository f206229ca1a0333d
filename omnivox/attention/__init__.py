"""Paged attention for the engine's AR stages: one forward-metadata object per step
(`metadata.AttentionMetadata`) and interchangeable backends behind one seam.

A backend is an object with
    name: str
    forward(q [N, H, D], k [N, Hkv, D], v [N, Hkv, D], k_cache [S, Hkv, D], v_cache [S, Hkv, D],
            meta: AttentionMetadata) -> [N, H, D]
which first writes k/v at meta.write_slots into the caches (one layer's pages of the KV pool),
then lets token i of row b (position p = seq_lens[b] - q_lens[b] + i) attend over positions
0..p of row b (max(0, p - meta.window + 1)..p with a sliding window), read through meta.block_table;
a windowed backend reads no key before its row's earliest window. Scale 1/sqrt(D). Whatever a backend derives from
the metadata (index tensors, masks) it builds once per step and caches in `meta.derived`.
"""
