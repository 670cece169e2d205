"""Finding a variant's rendered source under generated/ (``dplr-gen show``)."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Found:
    spec: str  # the package (spec) name
    spec_file: str
    variant: str
    targets: dict[str, Path]  # target -> rendered source


def packages(root: Path) -> dict[str, dict]:
    """Every rendered package under ``root``: spec name -> its index."""
    out = {}
    for p in sorted(root.glob("*/index.json")):
        index = json.loads(p.read_text())
        index["_dir"] = p.parent
        out[index["spec"]] = index
    return out


def find(variant: str, root: Path, spec: str | None = None) -> list[Found]:
    """The packages (only ``spec``'s, if given) that hold ``variant``, with the source of each target."""
    found = []
    for name, index in packages(root).items():
        entry = index["variants"].get(variant)
        if entry is None or (spec is not None and name != spec):
            continue
        targets = {t: index["_dir"] / e["source"] for t, e in entry["targets"].items()}
        found.append(Found(name, index.get("spec_file", f"specs/{name}.yaml"), variant, targets))
    return found


def nearest(variant: str, root: Path, spec: str | None = None, n: int = 5) -> list[str]:
    """The ``n`` variant names most like ``variant`` (each once), over every package or ``spec``'s."""
    names = sorted({v for name, index in packages(root).items() if spec in (None, name) for v in index["variants"]})
    return difflib.get_close_matches(variant, names, n=n, cutoff=0.0)
