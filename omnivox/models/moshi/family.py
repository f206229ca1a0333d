"""Kyutai's Moshi (full duplex) in the family registry: detected from a folder's config.json
(model_type "moshi", or Kyutai's file-name keys, which its releases carry without a model_type).
Not served yet (issue 43): `omnivox duplex` and `omnivox.Duplex` run it offline."""
from omnivox.serving import Family

FAMILY = Family(name="moshi", label="Moshi", model_types=("moshi",), demo="moshi-demo",
                demo_served_name="omnivox-demo-moshi", served="", chat=False,
                cloning=False, config_keys=("moshi_name", "mimi_name"),
                unserved="Moshi checkpoints are served by `omnivox duplex` offline for now")
