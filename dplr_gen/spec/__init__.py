"""Spec layer (data): the Pydantic spec models, GPU arch profiles, the Triton quirk registry and the YAML loader."""
