"""Toolchain layer: the Triton adapter (one module per job), AOT compiles in subprocesses, the cache, the build."""
