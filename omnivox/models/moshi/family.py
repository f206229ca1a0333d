"""Kyutai's Moshi (full duplex) in the family registry: detected from a folder's config.json
(model_type "moshi", or Kyutai's file-name keys, which its releases carry without a model_type).
Served through the engine as a `DuplexModel` (`served.py`: `open_duplex`): `omnivox serve` serves it
(WebSocket /api/chat); `omnivox duplex` and `omnivox.Duplex` run it offline, on the engine;
generate, speak and bench refuse it (`unserved`)."""
from omnivox.serving import Family

FAMILY = Family(name="moshi", label="Moshi", model_types=("moshi",), demo="moshi-demo",
                demo_served_name="omnivox-demo-moshi", served="omnivox.models.moshi.served:MoshiServed", chat=False,
                cloning=False, stages=("encoder", "lm", "vocoder"), kv_stages=("lm",),
                graph="omnivox.models.moshi.stages.graph:served_graph", config_keys=("moshi_name", "mimi_name"),
                unserved="Moshi is full duplex: `omnivox serve` serves it (WebSocket /api/chat) and `omnivox duplex` "
                         "runs it offline; generate, speak and bench do not take it")
