"""Arch profiles (data in ``data/arches.yaml``) and the named template flags derived from them."""

from __future__ import annotations

import functools
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field


class KnobDefaults(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    num_warps: int = Field(4, ge=1, le=16)
    num_stages: int = Field(2, ge=1, le=8)


class ArchProfile(BaseModel):
    """One NVIDIA compute capability as the generator sees it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    cc: int = Field(ge=50, le=200)
    smem_per_block: int = Field(gt=0, description="opt-in shared memory per block, bytes")
    mma: Literal["none", "v2", "v3", "v5"]
    arch_specific: bool = False
    dtypes: tuple[Literal["bf16", "fp16", "fp32"], ...]
    defaults: KnobDefaults = KnobDefaults()

    @property
    def target(self) -> str:
        return f"sm_{self.cc}"

    def base_flags(self) -> dict[str, bool]:
        """Template flags implied by the matrix unit alone (quirks for a Triton version add more)."""
        return {
            # wgmma / tcgen05 give each dot its own layout: a dot result feeding another dot through a
            # cast or transpose needs an mma->mma conversion, the pattern behind the Hopper aborts.
            "no_mma_chaining": self.mma in ("v3", "v5"),
            # tcgen05 accumulators live in tensor memory; two dots into one accumulator miscompile there.
            "separate_accumulators": self.mma == "v5",
            # the token pass as the Gluon kernel (knob chunk.bwd.gluon; set per unit in variants.build_units)
            "gluon_token_pass": False,
            "needs_allocator": False,
        }


@functools.cache
def load_arches() -> dict[str, ArchProfile]:
    text = resources.files("dplr_gen").joinpath("data/arches.yaml").read_text()
    raw = yaml.safe_load(text)
    return {key: ArchProfile.model_validate(val) for key, val in raw.items()}


class UnknownArchError(ValueError):
    pass


def get_arch(target: str | int) -> ArchProfile:
    """``"sm_90"``, ``"90"`` or ``90`` -> profile; unknown archs name the known ones."""
    key = f"sm_{target}" if isinstance(target, int) or str(target).isdigit() else str(target)
    arches = load_arches()
    if key not in arches:
        raise UnknownArchError(
            f"unknown target arch {target!r}: known archs are {', '.join(arches)}; "
            "add a profile to dplr_gen/data/arches.yaml to support a new GPU generation"
        )
    return arches[key]
