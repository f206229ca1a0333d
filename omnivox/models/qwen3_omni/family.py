"""Qwen3-Omni in the family registry."""
from omnivox.serving import Family

FAMILY = Family(name="qwen3_omni", label="Qwen3-Omni", model_types=("qwen3_omni_moe",), demo="qwen-demo",
                demo_served_name="omnivox-demo-qwen3-omni",
                served="omnivox.models.qwen3_omni.served:Qwen3OmniServed", chat=True, cloning=False,
                stages=("thinker", "talker", "vocoder", "encoder"), kv_stages=("thinker", "talker"),
                graph="omnivox.models.qwen3_omni.stages.graph:served_graph")
