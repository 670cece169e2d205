"""Test session setup: kernels run in Triton's interpreter on CPU; builds use a private cache."""

from __future__ import annotations

import os
import tempfile

# Must be set before any kernel module is imported: triton.jit reads it when a kernel is defined.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DPLR_GEN_CACHE_DIR", tempfile.mkdtemp(prefix="dplr-gen-test-cache-"))
