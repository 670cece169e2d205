"""dplr-gen's environment settings (DPLR_GEN_*): what each one takes, read strictly.

A value a setting does not take is an error naming the variable and the values it takes, raised where the setting
is read (a typo such as DPLR_GEN_CHECK_LOWER_BOUND=of would otherwise leave the check on, silently). An unknown
DPLR_GEN_* name is said once, with the nearest known name. Cheap to import: the ops' hot paths read settings.
"""

from __future__ import annotations

import difflib
import functools
import os
import warnings
from pathlib import Path

PREFIX = "DPLR_GEN_"
# DPLR_GEN_CHECK_LOWER_BOUND's values -> the check's mode (runtime.gate_check)
CHECK_MODES = {"1": "device", "sync": "sync", "0": "off", "": "off"}

# every setting dplr-gen reads -> the values it takes, as the errors say them
SETTINGS: dict[str, str] = {
    "DPLR_GEN_CACHE_DIR": "a directory for the kernel cache, made absolute (unset or empty: the user's cache folder)",
    "DPLR_GEN_NO_JIT": "1 (never compile at run time: an error names the spec entry to build) or 0, empty or unset "
                       "(compile what the build did not)",
    "DPLR_GEN_KEEP_STUBS": "1 or unset (keep launch stubs and what Triton passes them in dplr-gen's cache; built "
                           "kernels then launch without Triton) or 0 or empty (Triton's cache only, every launch "
                           "through Triton)",
    "DPLR_GEN_JIT_JOBS": "a whole number of compile processes for a variant generated on demand, 1 or more "
                         "(0, empty or unset: one per CPU)",
    "DPLR_GEN_SPEC": "the name of a spec under generated/ (empty or unset: the spec whose targets cover the GPU)",
    "DPLR_GEN_CHECK_LOWER_BOUND": "1 or unset (lower_bound checked on the device), sync (checked on the host, with "
                                  "the exact message), 0 or empty (not checked)",
    "DPLR_GEN_COMMIT": "the commit a benchmark record names (benchmarks/; any text)",
}


class SettingError(ValueError):
    """A DPLR_GEN_* variable set to a value it does not take."""


class SettingWarning(UserWarning):
    """A DPLR_GEN_* variable that dplr-gen does not read (a misspelt name)."""


def invalid(name: str, value: str, why: str = "") -> SettingError:
    """The error for ``name=value``: the variable, the value, and what it takes."""
    return SettingError(f"{name}={value!r} is not valid{f' ({why})' if why else ''}: {name} takes {SETTINGS[name]}")


def flag(name: str, default: bool) -> bool:
    """An on/off setting: "1" on; "0" or empty off; unset ``default``; anything else a SettingError."""
    value = os.environ.get(name)
    if value is None:
        return default
    if value not in ("", "0", "1"):
        raise invalid(name, value)
    return value == "1"


def count(name: str) -> int:
    """A whole-number setting, 0 where unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return 0
    if not value.isdigit():
        raise invalid(name, value)
    return int(value)


def directory(name: str) -> Path | None:
    """A folder setting, absolute (manifests record it, and a relative one would move with the working
    directory); None where unset or empty. A path that exists and is not a folder is a SettingError."""
    value = os.environ.get(name)
    if not value:
        return None
    path = Path(value).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise invalid(name, value, "it is a file")
    return path


def unknown() -> list[str]:
    """One line per DPLR_GEN_* variable in the environment that dplr-gen does not read, with the nearest name."""
    lines = []
    for name in sorted(n for n in os.environ if n.startswith(PREFIX) and n not in SETTINGS):
        close = difflib.get_close_matches(name, SETTINGS, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        lines.append(f"{name} is not a dplr-gen setting, it is ignored; {hint}(settings: {', '.join(SETTINGS)})")
    return lines


@functools.cache
def warn_unknown() -> None:
    """Warn once per process about DPLR_GEN_* variables dplr-gen does not read."""
    for line in unknown():
        warnings.warn(line, SettingWarning, stacklevel=3)


def check(name: str) -> None:
    """Raise a SettingError where setting ``name`` holds a value it does not take. DPLR_GEN_SPEC is checked
    against the specs under generated/ where it is used (runtime.loader.all_packages)."""
    if name == "DPLR_GEN_CACHE_DIR":
        directory(name)
    elif name in ("DPLR_GEN_NO_JIT", "DPLR_GEN_KEEP_STUBS"):
        flag(name, False)
    elif name == "DPLR_GEN_JIT_JOBS":
        count(name)
    elif name == "DPLR_GEN_CHECK_LOWER_BOUND" and os.environ.get(name, "1") not in CHECK_MODES:
        raise invalid(name, os.environ[name])
