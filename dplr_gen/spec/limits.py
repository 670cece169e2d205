"""Limits every spec and every call obeys, as plain constants: the spec models validate against them and the
run-time checks read them (this module imports nothing, so the run-time path pulls in no pydantic or yaml)."""

from __future__ import annotations

# head dims K and V any variant may have (the templates' tiles are powers of two from 16 to 256, masked)
HEAD_DIM_MIN, HEAD_DIM_MAX = 16, 256
