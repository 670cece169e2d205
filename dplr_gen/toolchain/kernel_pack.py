"""A built spec's kernels in one archive: build once (a CPU machine will do), load on other machines.

``pack`` writes what launching needs of every kernel the spec's last build stored (each cache entry's meta.json,
the kernel's metadata json and its binary; not the intermediate forms, ~85% of an entry's bytes) and a
``pack.json`` naming the spec and the Triton release. ``unpack`` adds the entries to this machine's cache, each
as the build stores one (cache.write_entry: assembled aside and renamed into place under the entry's lock, so a
concurrent build or an interrupted unpack leaves no half entry; an entry already there is kept). A build of the
spec then finds every kernel in the cache and compiles none: it renders, checks and writes the package's
manifest, seconds instead of minutes. Kernels load only under the Triton release that compiled them, so
``unpack`` refuses an archive of another release.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import cache
from .clean import manifest_entries
from .launch import LAUNCH_EXTS
from .package_kernels import cache_root_of, read_manifest

PACK_META = "pack.json"
# triton-<release>/<key[:2]>/<key>/<file>: anything else in an archive is refused (no path leaves the cache)
_MEMBER = re.compile(r"triton-(?P<tv>[0-9A-Za-z.+_-]+)/(?P<pre>[0-9a-f]{2})/(?P<key>[0-9a-f]{64})/(?P<file>[A-Za-z0-9_.-]+)")


@dataclass(frozen=True)
class Unpacked:
    spec: str
    triton_version: str
    added: int  # entries new to the cache
    kept: int  # entries the cache already held


def _launch_file(name: str) -> bool:
    """A file launching reads: the kernel's metadata and binary; the entry's meta.json is a json too."""
    return name.rsplit(".", 1)[-1] in LAUNCH_EXTS


def pack(directory: Path, out: Path) -> dict[str, Any]:
    """Write the kernels of the package built in ``directory`` (generated/<spec>/) to the gzipped tar ``out``
    (written aside and renamed: a reader never sees a part); returns its pack.json record."""
    manifest = read_manifest(directory)
    if manifest is None:
        raise FileNotFoundError(f"{directory} has no manifest.json: build the spec first (`dplr-gen build`)")
    tv, root = str(manifest["triton_version"]), cache_root_of(manifest)
    keys = sorted(key for _, key in manifest_entries(manifest))
    gone = [key for key in keys if not cache.present(key, tv, root)]
    if gone:
        raise FileNotFoundError(f"{len(gone)} of the {len(keys)} kernels the build of {manifest['spec']} stored are "
                                f"gone from {root}: build the spec again first")
    record = {"spec": manifest["spec"], "triton_version": tv, "kernels": len(keys),
              "targets": sorted({u["target"] for u in manifest["units"].values()}),
              "generator_version": manifest.get("generator_version")}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            data = json.dumps(record, indent=1, sort_keys=True).encode()
            info = tarfile.TarInfo(PACK_META)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            for key in keys:
                entry = cache.entry_dir(key, tv, root)
                for f in sorted(entry.iterdir()):
                    if f.is_file() and _launch_file(f.name):
                        tar.add(f, arcname=f"triton-{tv}/{key[:2]}/{key}/{f.name}", recursive=False)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return record


def unpack(archive: Path, installed: str, root: Path | None = None) -> Unpacked:
    """Add the entries of ``archive`` (from ``pack``) to the cache at ``root`` (default: this machine's). The
    archive's Triton release must be ``installed``, the one this process loads kernels with."""
    with tarfile.open(archive, "r:*") as tar:
        members = tar.getmembers()
        try:
            record = json.load(tar.extractfile(PACK_META))  # type: ignore[arg-type]
        except KeyError:
            raise ValueError(f"{archive}: no {PACK_META}; not an archive `dplr-gen pack` wrote") from None
        tv = str(record.get("triton_version"))
        if tv != installed:
            raise ValueError(f"{archive} holds kernels compiled by Triton {tv}, but this machine has Triton "
                             f"{installed}: they load only under the release that compiled them (pack them again "
                             f"on a machine with Triton {installed}, or install Triton {tv})")
        entries: dict[str, dict[str, tarfile.TarInfo]] = defaultdict(dict)
        for m in members:
            if m.name == PACK_META:
                continue
            match = _MEMBER.fullmatch(m.name)
            if not m.isfile() or match is None or match["tv"] != tv or match["key"][:2] != match["pre"]:
                raise ValueError(f"{archive}: unexpected member {m.name!r} (an archive `dplr-gen pack` wrote holds "
                                 f"only {PACK_META} and triton-{tv}/<key[:2]>/<key>/<file>)")
            entries[match["key"]][match["file"]] = m
        added = kept = 0
        for key, files in sorted(entries.items()):
            if cache.META not in files:
                raise ValueError(f"{archive}: entry {key} has no {cache.META}")
            with cache.locked(key, tv, root):
                if cache.present(key, tv, root):
                    kept += 1
                    continue
                data = {name: tar.extractfile(m).read() for name, m in files.items()}  # type: ignore[union-attr]
                meta = json.loads(data.pop(cache.META))
                cache.write_entry(key, tv, data, meta, root)
                added += 1
    return Unpacked(str(record.get("spec")), tv, added, kept)
