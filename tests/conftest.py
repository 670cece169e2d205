"""Test session setup: kernels run in Triton's interpreter on CPU; builds use a private cache."""

from __future__ import annotations

import os
import tempfile

# Must be set before any kernel module is imported: triton.jit reads it when a kernel is defined.
os.environ.setdefault("TRITON_INTERPRET", "1")
# triton.language's own @jit functions (tl.sum, tl.cumsum, ...) are defined when it is first imported, as
# interpreted or compiled functions by this variable at that moment: import it now, so that a test which
# sets TRITON_INTERPRET=0 for a while (tests/test_runtime.py) cannot be the first and leave them compiled-only
# for every interpreted test after it in the same process.
import triton.language  # noqa: E402, F401
os.environ.setdefault("DPLR_GEN_CACHE_DIR", tempfile.mkdtemp(prefix="dplr-gen-test-cache-"))
