"""The quirk registry: known Triton compiler failures per (arch, Triton release), as data.

Entries live in ``data/quirks.yaml``; this module validates them (strictly: a typo must not silently
disable a workaround) and turns the ones that apply to a build into template flags and knob limits.
"""

from __future__ import annotations

import functools
from importlib import resources
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version
from pydantic import BaseModel, ConfigDict, Field, RootModel, field_validator, model_validator

from .models import check_when, when_matches

Effect = Literal["abort", "miscompile", "compile_error", "hang"]


class Avoid(BaseModel):
    """What avoids a quirk. Empty means nothing is known to (the entry still documents the risk)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    flags: dict[str, bool] = Field(default_factory=dict, description="template flags to set")
    max_num_warps: int | None = Field(None, ge=1, le=16, description="cap on num_warps for every stage")
    stage_max_num_warps: dict[str, int] = Field(
        default_factory=dict, description='cap on num_warps for one "op.stage" (e.g. "chunk.bwd")'
    )
    needs_allocator: bool = Field(False, description="the runtime must call triton.set_allocator")
    refuse: str | None = Field(None, min_length=1, description="nothing avoids it: refuse with this reason")

    @field_validator("stage_max_num_warps")
    @classmethod
    def _stage_caps(cls, v: dict[str, int]) -> dict[str, int]:
        for stage, n in v.items():
            if "." not in stage:
                raise ValueError(f'stage {stage!r} must be "op.stage", e.g. "chunk.bwd"')
            if not 1 <= n <= 16:
                raise ValueError(f"num_warps cap {n} for {stage} is outside 1..16")
        return v


ArchItem = Union[int, str]


class Quirk(BaseModel):
    """One known failure of a Triton release on some archs."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9.\-]*$", description="stable name, recorded in the sources that avoid it")
    archs: tuple[ArchItem, ...] = Field(min_length=1, description='sm numbers or ranges like "100-103"')
    triton: str = Field(description='PEP 440 specifier on the Triton release, e.g. ">=3.0,<3.2"')
    pattern: str = Field(min_length=1, description="the code pattern that fails")
    effect: Effect = Field(description="what the failure does; a miscompile is refused at run time unless avoided")
    reference: str = Field(min_length=1, description="where it is shown (issue, test, doc)")
    avoid: Avoid = Field(default_factory=Avoid, description="what the generator does about it")
    when: dict[str, tuple[Any, ...]] = Field(
        default_factory=dict,
        description="variant parameters the failure is limited to, e.g. {chunk_size: [64]}; empty: every variant",
    )

    @field_validator("when")
    @classmethod
    def _when(cls, v: dict[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
        check_when(v)
        return v

    @field_validator("archs")
    @classmethod
    def _archs(cls, v: tuple[ArchItem, ...]) -> tuple[ArchItem, ...]:
        for a in v:
            lo, hi = _arch_range(a)
            if not (50 <= lo <= hi <= 200):
                raise ValueError(f"arch {a!r} is not an sm number or range between 50 and 200")
        return v

    @field_validator("triton")
    @classmethod
    def _specifier(cls, v: str) -> str:
        try:
            SpecifierSet(v)
        except InvalidSpecifier as e:
            raise ValueError(f"not a version specifier: {v!r} ({e})") from None
        return v

    def matches_arch(self, arch: int) -> bool:
        return any(lo <= int(arch) <= hi for lo, hi in map(_arch_range, self.archs))

    def matches_triton(self, version: Version | str) -> bool:
        # compare releases: "3.7.0+git..." or "3.7.1rc1" must fall where 3.7.0 / 3.7.1 do
        v = Version(Version(str(version)).base_version)
        return SpecifierSet(self.triton).contains(v, prereleases=True)

    def matches_variant(self, params: Mapping[str, Any] | None) -> bool:
        """True when the variant falls under ``when`` (an unknown variant, None, is assumed to)."""
        return params is None or when_matches(self.when, params)

    def applies(self, arch: int, version: Version | str, variant: Mapping[str, Any] | None = None) -> bool:
        return self.matches_arch(arch) and self.matches_triton(version) and self.matches_variant(variant)


def _arch_range(a: ArchItem) -> tuple[int, int]:
    """``90`` -> (90, 90); ``"100-103"`` -> (100, 103); ``"sm_90"`` -> (90, 90)."""
    if isinstance(a, bool):  # bool is an int subclass: reject explicitly
        raise ValueError(f"arch {a!r} is not an sm number")
    if isinstance(a, int):
        return a, a
    s = a.strip().removeprefix("sm_")
    lo, sep, hi = s.partition("-")
    try:
        return (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise ValueError(f"arch {a!r} is not an sm number or range like '100-103'") from None


class QuirkFile(RootModel[list[Quirk]]):
    """The whole ``quirks.yaml``: a list of entries with unique ids."""

    @model_validator(mode="after")
    def _unique(self) -> "QuirkFile":
        seen: set[str] = set()
        for q in self.root:
            if q.id in seen:
                raise ValueError(f"duplicate quirk id {q.id!r}")
            seen.add(q.id)
        return self


def parse_quirks(data: Any) -> list[Quirk]:
    """Validate already-loaded YAML data (raises ``pydantic.ValidationError`` naming the bad field)."""
    return list(QuirkFile.model_validate(data).root)


def load_quirks_file(path: Path) -> list[Quirk]:
    return parse_quirks(yaml.safe_load(Path(path).read_text()))


@functools.cache
def load_quirks() -> tuple[Quirk, ...]:
    """The registry shipped in ``dplr_gen/spec/data/quirks.yaml`` (validated once, cached)."""
    text = resources.files("dplr_gen.spec").joinpath("data/quirks.yaml").read_text()
    return tuple(parse_quirks(yaml.safe_load(text)))


def active_quirks(
    arch: int, triton_version: Version | str, quirks: Any = None, variant: Mapping[str, Any] | None = None
) -> list[Quirk]:
    """Entries that apply to ``sm_<arch>`` under ``triton_version`` (and to ``variant``'s parameters when
    given; without it, entries limited by ``when`` count too), in file order."""
    pool = load_quirks() if quirks is None else quirks
    return [q for q in pool if q.applies(arch, triton_version, variant)]


def arch_flags(
    arch: int, triton_version: Version | str, base_flags: dict[str, Any], quirks: Any = None,
    variant: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], list[str], str | None]:
    """Merge the ``avoid`` parts of every quirk active for ``variant`` (all of them when None) onto
    ``base_flags``.

    Returns ``(flags, limits, applied_ids, refusal)``:
      * flags: ``base_flags`` updated with each quirk's flags (a workaround flag set to True by any quirk
        stays True: turning a workaround on never hurts correctness);
      * limits: ``max_num_warps`` (smallest cap), ``stage_max_num_warps`` (smallest cap per stage),
        ``needs_allocator`` -- only the keys some quirk sets;
      * applied_ids: ids of the active quirks;
      * refusal: the joined ``refuse`` reasons, or None when the pair can be built.
    """
    flags = dict(base_flags)
    limits: dict[str, Any] = {}
    applied: list[str] = []
    refusals: list[str] = []
    forced: set[str] = set()
    for q in active_quirks(arch, triton_version, quirks, variant):
        applied.append(q.id)
        a = q.avoid
        for k, v in a.flags.items():
            if k in forced:  # an earlier quirk turned this workaround on: keep it on
                continue
            flags[k] = v
            if v is True:
                forced.add(k)
        if a.max_num_warps is not None:
            limits["max_num_warps"] = min(limits.get("max_num_warps", a.max_num_warps), a.max_num_warps)
        for stage, n in a.stage_max_num_warps.items():
            caps = limits.setdefault("stage_max_num_warps", {})
            caps[stage] = min(caps.get(stage, n), n)
        if a.needs_allocator:
            limits["needs_allocator"] = True
        if a.refuse:
            refusals.append(f"{a.refuse} [{q.id}]")
    return flags, limits, applied, ("; ".join(refusals) if refusals else None)

