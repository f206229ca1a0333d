"""The OpenAI-compatible HTTP API (`omnivox serve`): `create_app(omni, served_name, ...)`."""
