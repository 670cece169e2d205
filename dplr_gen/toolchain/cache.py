"""Content-addressed store of compiled kernels.

An entry is a folder ``<root>/triton-<version>/<key[:2]>/<key>/`` holding every artifact Triton produced and
``meta.json``, which is written last: an entry without it does not exist. Entries are assembled in a private
temporary folder and renamed into place, under a per-key file lock, so two builds at once or a build killed
midway never leave a half-written entry that a reader would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from . import settings

META = "meta.json"


def cache_root() -> Path:
    """DPLR_GEN_CACHE_DIR (a folder, made absolute: manifests record it), else the user's cache folder."""
    found = settings.directory("DPLR_GEN_CACHE_DIR")
    if found is None:
        import platformdirs  # (here: a process that loads built kernels reads their manifest's root instead)

        found = Path(platformdirs.user_cache_dir("dplr-gen"))
    return found


def cache_key(**parts: Any) -> str:
    """Hash of everything that decides the compiled bytes (source, kernel, signature, constants, options,
    target, Triton version)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def entry_dir(key: str, triton_version: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / f"triton-{triton_version}" / key[:2] / key


def present(key: str, triton_version: str, root: Path | None = None) -> bool:
    """Whether the entry is complete: one stat of its meta.json, cheap enough to check every kernel of a spec
    whenever a status says "built"."""
    return (entry_dir(key, triton_version, root) / META).is_file()


def read_entry(key: str, triton_version: str, root: Path | None = None) -> dict[str, Any] | None:
    """The entry's metadata, or None if it is absent or incomplete."""
    meta = entry_dir(key, triton_version, root) / META
    try:
        return json.loads(meta.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def entries(triton_version: str, root: Path | None = None) -> Iterator[dict[str, Any]]:
    """The metadata of every complete entry stored for ``triton_version`` (unreadable ones skipped)."""
    for meta in ((root or cache_root()) / f"triton-{triton_version}").glob(f"*/*/{META}"):
        try:
            yield json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError):
            continue


@contextmanager
def locked(key: str, triton_version: str, root: Path | None = None) -> Iterator[None]:
    from filelock import FileLock  # (here: only writers lock, and the runtime's loads write nothing)

    d = entry_dir(key, triton_version, root)
    d.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(d) + ".lock"):
        yield


def write_entry(
    key: str, triton_version: str, files: dict[str, bytes], meta: dict[str, Any], root: Path | None = None,
    replace: bool = False,
) -> Path:
    """Store ``files`` and then ``meta`` atomically; returns the entry folder. Call under :func:`locked`.
    An existing complete entry is kept, or with ``replace`` replaced (``build --force``)."""
    final = entry_dir(key, triton_version, root)
    if (final / META).exists() and not replace:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:12]}-", dir=final.parent))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
        if final.exists():  # the entry replaced, or a stale folder without meta.json left by a crash
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def add_to_meta(key: str, triton_version: str, extra: dict[str, Any], root: Path | None = None) -> dict[str, Any]:
    """A complete entry's metadata with ``extra`` added, written over the old in one rename (readers see either);
    call under :func:`locked`. The compiled files are not touched."""
    path = entry_dir(key, triton_version, root) / META
    meta = {**json.loads(path.read_text()), **extra}
    atomic_write_text(path, json.dumps(meta, indent=1, sort_keys=True))
    return meta


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file so that readers see the old or the new content, never a part."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """``atomic_write_text`` for bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
