"""Which Triton releases and GPU archs the adapter speaks to: the installed version and whether it can target an
arch (asked before compiling: a release asked for an arch it lacks may abort the process)."""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version

# Oldest and newest releases this adapter was checked against; newer ones are tried but flagged.
MIN_TRITON = Version("3.1.0")
MAX_TESTED_TRITON = Version("3.9.0")

# arch -> first Triton release that can compile for it. Seen with 3.1.0 and 3.2.0: for sm_100 and sm_120
# any tl.dot aborts the process (AccelerateMatmul.cpp "computeCapability not supported", SIGABRT) and a
# dot-free kernel fails in ptxas ("Value 'sm_100' is not defined for option 'gpu-name'").
KNOWN_ARCHS: dict[int, Version] = {
    75: Version("3.1.0"),
    80: Version("3.1.0"),
    86: Version("3.1.0"),
    87: Version("3.1.0"),
    89: Version("3.1.0"),
    90: Version("3.1.0"),
    100: Version("3.3.0"),
    120: Version("3.3.0"),
}


class TargetUnsupported(ValueError):
    """Raised instead of asking a Triton release to compile for an arch it cannot target."""


def triton_version() -> Version:
    """The installed Triton's version, read from package metadata (no import of triton: that is slow)."""
    try:
        return Version(importlib.metadata.version("triton"))
    except importlib.metadata.PackageNotFoundError:
        import triton  # a source build without dist-info still has __version__

        return Version(triton.__version__)


def _base(version: Version | str | None) -> Version:
    """Drop local/dev/pre parts (``3.6.0+git1234`` -> ``3.6.0``) so range checks compare releases."""
    v = triton_version() if version is None else Version(str(version))
    return Version(v.base_version)


def can_target(arch: int, version: Version | str | None = None) -> tuple[bool, str]:
    """Whether Triton ``version`` (default: installed) can compile for ``sm_<arch>`` without aborting.

    Consulted before compiling: a release asked for an arch it lacks may kill the whole process.
    Returns ``(ok, reason)``; reason is empty when ok and nothing is worth saying.
    """
    v = _base(version)
    if v < MIN_TRITON:
        return False, f"Triton {v} is older than the oldest supported release {MIN_TRITON}"
    first = KNOWN_ARCHS.get(int(arch))
    if first is None:
        known = ", ".join(f"sm_{a}" for a in sorted(KNOWN_ARCHS))
        return False, f"sm_{arch} is not a known target (known: {known})"
    if v < first:
        return False, f"Triton {v} cannot target sm_{arch} (first release that can: {first}); it aborts when asked"
    if v.release[:2] > MAX_TESTED_TRITON.release[:2]:
        return True, f"Triton {v} is newer than the newest checked release {MAX_TESTED_TRITON}"
    return True, ""
