"""Arch profiles (data in ``data/arches.yaml``) and the named template flags derived from them."""

from __future__ import annotations

import functools
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field


class KnobDefaults(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    num_warps: int = Field(4, ge=1, le=16, description="warps per program where a spec sets none")
    num_stages: int = Field(2, ge=1, le=8, description="pipelining depth where a spec sets none")


class ArchProfile(BaseModel):
    """One NVIDIA compute capability as the generator sees it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="the GPUs it covers, for messages")
    cc: int = Field(ge=50, le=200, description="compute capability as one number (sm_86: 86); the target is sm_<cc>")
    smem_per_block: int = Field(gt=0, description="opt-in shared memory per block, bytes: kernels above it fail the build")
    mma: Literal["none", "v2", "v3", "v5"] = Field(description="matrix unit Triton uses: none (no tensor-core dot), v2 (mma.sync, sm_80+), v3 (wgmma, sm_90), v5 (tcgen05, sm_100); decides template flags")
    arch_specific: bool = Field(False, description="compiled for sm_XXa: runs on exactly this arch only")
    dtypes: tuple[Literal["bf16", "fp16", "fp32"], ...] = Field(description="input dtypes the arch can build; others are refused")
    defaults: KnobDefaults = Field(KnobDefaults(), description="knob values where a spec sets none")

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
            # fp32 dots at tf32x3 written as three tf32 dots (set by a quirk where the option itself aborts)
            "split_tf32x3": False,
            "needs_allocator": False,
        }


@functools.cache
def load_arches() -> dict[str, ArchProfile]:
    text = resources.files("dplr_gen.spec").joinpath("data/arches.yaml").read_text()
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
            "add a profile to dplr_gen/spec/data/arches.yaml to support a new GPU generation (docs/specs.md lists its "
            "fields)"
        )
    return arches[key]
