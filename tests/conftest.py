"""Test session setup: kernels run in Triton's interpreter on CPU; builds use a private cache."""

from __future__ import annotations

import os
import tempfile

# Must be set before any kernel module is imported: triton.jit reads it when a kernel is defined. Compiled where
# tests/test_chunk_kernels.py is asked to run on a GPU (CHUNK_TEST_DEVICE=cuda): triton.language below must then be
# imported compiled too, or Triton's Gluon module (imported by a compiled launch) refuses its interpreted functions.
os.environ.setdefault("TRITON_INTERPRET", "1" if os.environ.get("CHUNK_TEST_DEVICE", "cpu") == "cpu" else "0")
# triton.language's own @jit functions (tl.sum, tl.cumsum, ...) are defined when it is first imported, as
# interpreted or compiled functions by this variable at that moment: import it now, so that a test which
# sets TRITON_INTERPRET=0 for a while (tests/test_runtime.py) cannot be the first and leave them compiled-only
# for every interpreted test after it in the same process.
import triton.language  # noqa: E402, F401
os.environ.setdefault("DPLR_GEN_CACHE_DIR", tempfile.mkdtemp(prefix="dplr-gen-test-cache-"))
