"""Fish Audio S2 Pro in the family registry."""
from omnivox.serving import Family

FAMILY = Family(name="fish_s2", label="Fish S2", model_types=("fish_qwen3_omni", "dual_ar"), demo="fish-demo",
                demo_served_name="omnivox-demo-fish-s2",
                served="omnivox.models.fish_s2.served:FishS2Served", chat=False, cloning=True,
                stages=("slow_ar", "vocoder"), kv_stages=("slow_ar",),
                graph="omnivox.models.fish_s2.stages.graph:served_graph")
