"""Spec models: what a ``specs/*.yaml`` file may say, validated strictly (unknown keys are errors)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import yaml_marks
from .arch import UnknownArchError, get_arch
from .limits import HEAD_DIM_MAX, HEAD_DIM_MIN

DType = Literal["bf16", "fp16", "fp32"]
Op = Literal["chunk", "fused_recurrent"]
ChunkSize = Literal[16, 32, 64]
HeadDim = Annotated[int, Field(ge=HEAD_DIM_MIN, le=HEAD_DIM_MAX)]
NAME_PATTERN = r"^[a-z][a-z0-9_]*$"  # a spec's name: a Python package name under generated/

# Stages (one kernel each) that tuning may name, per op; templates read knobs by these names. fused_recurrent.step:
# the decode step's kernel (every sequence one token long), fused_recurrent.fwd the loop over tokens.
STAGES: dict[str, tuple[str, ...]] = {
    "fused_recurrent": ("fwd", "step"),
    "chunk": ("prep", "fwd", "bwd_dh", "bwd", "fwd_small", "bwd_dh_small"),
}
# Stages that exist only where a spec gives them knobs, each a second compiled copy of another stage's kernels
# (copy -> original): the state passes (forward and states-only: fwd_small; reverse: bwd_dh_small), launched
# instead of the first when its grid would not fill the device (fewer programs than SMs: one or two sequences
# of few heads), where other tiles win. A quirk's warp cap on the original applies to its copy too.
STAGE_COPIES: dict[str, dict[str, str]] = {
    "fused_recurrent": {},
    "chunk": {"fwd_small": "fwd", "bwd_dh_small": "bwd_dh"},
}


# Knobs that only some stages take, and those stages: `chunk`, the token pass walks longer chunks than the
# variant's; `overlap`, the reverse pass runs beside the states pass; `block_k`, the token pass splits its K
# columns over several programs; `states_every`, h and dh are kept for every second token-pass chunk only;
# `gluon`, the token pass is the Gluon kernel (dplr_gen/render/templates/chunk_dplr_bwd_gluon.py.jinja);
# `lazy_exact_gates`, any-gate exponents from the factored form's differences, the exact sums only where needed;
# `split_exact`, the any-gate preps as a factored-form kernel and an exact-form kernel for the chunks it flags;
# `divisible_t`, the small-grid copies built once more for T divisible by 16.
STAGE_ONLY_KNOBS: dict[str, tuple[str, ...]] = {
    "chunk": ("chunk.bwd",),
    "overlap": ("chunk.bwd_dh",),
    "block_k": ("chunk.bwd",),
    "states_every": ("chunk.bwd",),
    "gluon": ("chunk.bwd",),
    "lazy_exact_gates": ("chunk.prep",),
    "split_exact": ("chunk.prep",),
    "launch_below_sms": ("chunk.fwd_small", "chunk.bwd_dh_small"),
    "segments": ("chunk.fwd_small", "chunk.bwd_dh_small"),
    "divisible_t": ("chunk.fwd_small", "chunk.bwd_dh_small"),
}

# Variant parameters (the keys of variants.Variant.params()) that `when` conditions may name: the spec's
# variant_tuning rules and the quirk registry's entries.
VARIANT_KEYS = frozenset(
    {"op", "dtype", "gate_dtype", "K", "V", "chunk_size", "varlen", "gate_bound", "state_dtype", "dot_precision"}
)


def check_when(when: Mapping[str, Any], allowed: frozenset[str] = VARIANT_KEYS) -> None:
    """A `when` condition names known parameters, each with at least one value (ValueError otherwise)."""
    unknown = sorted(set(when) - allowed)
    if unknown:
        raise ValueError(f"unknown variant parameter(s) {unknown}; valid: {sorted(allowed)}")
    empty = sorted(k for k, vals in when.items() if not vals)
    if empty:
        raise ValueError(f"no values listed for {empty}: list the values the condition is limited to")


def when_matches(when: Mapping[str, Any], params: Mapping[str, Any]) -> bool:
    """Every parameter named in ``when`` has one of the listed values in ``params``."""
    return all(params.get(k) in vals for k, vals in when.items())


class SpecError(ValueError):
    """A spec file that cannot be used; the message names the file and the field."""


class LocatedError(ValueError):
    """A validator's errors about entries below the field it validates, each with the entry's path from there
    (e.g. ("tuning", "chunk.bwdd") from the spec), so that load_spec names the line of each entry's key, not the
    spec's first line (a validator raises once: this carries every problem it found)."""

    def __init__(self, problems: list[tuple[tuple[int | str, ...], str]]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in problems))
        self.problems = problems


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Knobs(_Strict):
    """Per-stage tuning; None means the arch-derived default."""

    # stage chunk.bwd only: the token pass splits K into blocks of this many columns, one program each (each forms
    # the chunk's four [C, C] dA matrices in full: they contract over V only)
    block_k: int | None = Field(None, ge=16, le=256, description="chunk.bwd only: K columns per token-pass program (a power of two); splits K over programs")
    block_v: int | None = Field(None, ge=16, le=256, description="V columns per program (a power of two); smaller tiles fit less shared memory")
    num_warps: Literal[1, 2, 4, 8, 16] | None = Field(None, description="warps per program (default: the arch profile's)")
    num_stages: int | None = Field(None, ge=1, le=8, description="software-pipelining depth of loads (default: the arch profile's); more stages, more shared memory")
    # registers per thread the compiler may use (PTX .maxnreg; Triton's maxnreg): fewer registers, more
    # programs resident per SM, paid for in spills to local memory. None: the compiler's choice (up to 255).
    max_registers: int | None = Field(None, ge=64, le=255, description="registers per thread the compiler may use (maxnreg): more programs per SM, paid in spills")
    # stage chunk.bwd only: the token pass walks chunks of this many tokens (at least the variant's chunk size;
    # the state passes then store every (chunk / chunk_size)-th boundary state). Not 64: the registry's chunk-64
    # entries key on the variant's chunk size, so a chunk-64 token pass would escape them.
    chunk: Literal[16, 32] | None = Field(None, description="chunk.bwd only: tokens per token-pass chunk (at least the variant's chunk size)")
    # stage chunk.bwd only: the chunk-boundary states h and dh are kept once per this many tokens: the token pass's
    # chunk (the default), or twice the variant's chunk size where the token pass walks the variant's chunks; the
    # pass then derives the states in between from the kept ones (half the h and dh bytes, a few more products).
    states_every: Literal[16, 32, 64] | None = Field(None, description="chunk.bwd only: keep the boundary states h, dh once per this many tokens (half the bytes, a few more products)")
    # stage chunk.bwd only: the token pass is the persistent Gluon kernel (explicit layouts; the next tiles copied
    # into shared memory while the current ones are computed) where the Triton release has the Gluon API it is
    # written against (variants.GLUON_TRITON; elsewhere the Triton form is built). It covers bf16, 16-token chunks,
    # bounded gates, 4 warps, and K = V = 64 (a state kept for each chunk) or K = V = 128 dense with states_every
    # 32 only (variants.check_gluon).
    gluon: bool | None = Field(None, description="chunk.bwd only: the token pass as the persistent Gluon kernel, where the Triton release and the variant allow")
    # stage chunk.prep only, any-gate variants (no effect on bounded ones): every kernel of the unit takes a
    # chunk's gate exponents gamma', gamma_C - gamma as the factored form's differences of the cumulative sum, and
    # loads the gates again for exact sums (-inf and 0 among them) only in a chunk that cannot take the factored
    # form; the prep loads the gates before q, k, a, b. Without it every chunk sums exactly (two more loads and
    # cumsums a chunk).
    lazy_exact_gates: bool | None = Field(None, description="chunk.prep only, any-gate variants: exact gate sums only in chunks that cannot take the factored form (the others take its differences); the prep loads the gates first")
    # stage chunk.prep only, any-gate variants (no effect on bounded ones): each prep is two kernels, the factored
    # form for every chunk (with a flag per chunk: whether its exponents allow that form) and then, persistent,
    # the exact form for the chunks flagged 0, writing their outputs again. Neither kernel holds the other form's
    # code, which cost the single kernel registers and spills.
    split_exact: bool | None = Field(None, description="chunk.prep only, any-gate variants: the prep as a factored-form kernel for every chunk, then an exact-form kernel for the chunks whose exponents do not allow the factored form")
    # stage chunk.bwd_dh only: the reverse pass runs at the same time as the backward's recompute of the states
    # (a second CUDA stream; the two passes are independent), each a few hundred sequential programs that leave
    # most of the device idle. Costs the forward prep's operands kept alive through the reverse pass.
    overlap: bool | None = Field(None, description="chunk.bwd_dh only: run the reverse pass beside the states recompute on a second stream")
    # stages chunk.fwd_small and chunk.bwd_dh_small only: the small-grid copy is launched where the main kernel's
    # grid has fewer programs than this many times the device's SMs (None: 1, i.e. fewer programs than SMs).
    # Above 1 where the main kernel holds many programs per SM, so that a grid of a few per SM leaves it idle.
    launch_below_sms: int | None = Field(None, ge=1, le=64, description="small-grid stages only: launch the copy where the main grid has fewer programs than this many times the SMs (default 1)")
    # stages chunk.fwd_small and chunk.bwd_dh_small only, dense variants: where the small-grid copy runs, its pass
    # (the forward's and the states-only pass; the reverse pass) splits each sequence into up to this many segments
    # walked side by side. A first launch finds what each segment does to the state entering it (an affine map:
    # S_end = P S_start + L; backwards for the reverse pass); the pass over each segment then folds the maps of the
    # segments before it into its starting state. About three walks of work in place of one, over this many times
    # the programs: a gain only where the one walk leaves most SMs idle (docs/chunk_algorithm.md). 1: the kernels
    # are built (context parallelism's exchange needs the maps, dplr_gen/cp.py) but the op walks whole sequences.
    segments: int | None = Field(None, ge=1, le=64, description="small-grid stages only, dense variants: split each sequence into up to this many segments walked side by side (1: build the segment kernels for context parallelism, walk whole sequences)")
    # stages chunk.fwd_small and chunk.bwd_dh_small only, dense variants (no effect on varlen ones): the stage's
    # kernels are built a second time with T promised divisible by 16 (what Triton's JIT assumes of such a T:
    # the addresses of a sequence's rows are then known aligned), and the driver launches that build wherever T
    # is a multiple of 16.
    divisible_t: bool | None = Field(None, description="small-grid stages only, dense variants: also build the stage's kernels for T divisible by 16, launched wherever T is")

    @field_validator("block_k", "block_v")
    @classmethod
    def _pow2(cls, x: int | None) -> int | None:
        if x is not None and x & (x - 1):
            raise ValueError(f"block sizes must be powers of two (16..256), got {x}")
        return x


class TuningRule(_Strict):
    """Knobs for the variants (and targets) that match ``when``, e.g. {K: [128]} or {target: [sm_90], K: [128]}."""

    when: dict[str, list[Any]] = Field(min_length=1, description="variant parameters (or target) -> the values the rule applies to, e.g. {K: [128]}")
    tuning: dict[str, Knobs] = Field(min_length=1, description="\"op.stage\" -> knobs for the matching variants")

    @field_validator("when")
    @classmethod
    def _when(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        check_when(v, VARIANT_KEYS | {"target"})
        return v


class VariantAxes(_Strict):
    """One group of axes; the variants are their cross product (then filtered, with reasons)."""

    ops: list[Op] = Field(default_factory=lambda: ["chunk", "fused_recurrent"], min_length=1, description="chunk: training and prefill (chunk-parallel); fused_recurrent: decoding, token by token")
    dtypes: list[DType] = Field(min_length=1, description="dtypes of q, k, v, a, b (the ops pick the variant by the inputs' dtype); an arch may lack some")
    # an int means K = V; a pair is [K, V]
    head_dims: list[HeadDim | tuple[HeadDim, HeadDim]] = Field(min_length=1, description="head sizes: an int means K = V, a pair is [K, V]; 16 to 256")
    chunk_sizes: list[ChunkSize] = Field(default_factory=lambda: [64], min_length=1, description="tokens per chunk of the chunk op; changes rounding and speed, not the function")
    varlen: list[bool] = Field(default_factory=lambda: [False, True], min_length=1, description="false: dense [B, T, ...] batches; true: sequences laid end to end with cu_seqlens")
    # None: generic gate, safe for any gk <= 0 (gk = -inf included). A float L < 0: gk >= L is promised
    # (RWKV-7: -0.6065), which licenses factored exponents and tensor-core dots.
    gate_bounds: list[Annotated[float, Field(lt=0, ge=-20)] | None] = Field(default_factory=lambda: [None], description="null: any gate gk <= 0; a float L in [-20, 0): gk >= L is promised (lower_bound), licensing the faster factored form")
    # "same": gk is read in the input dtype; "fp32": gk is kept in float32 (fla allows fp32 gk with bf16 inputs)
    gate_dtype: Literal["same", "fp32"] = Field("fp32", description="fp32: gk kept in float32 (takes gk of any dtype); same: gk read in the input dtype (no conversion, fewer bytes)")
    state_dtype: Literal["fp32"] = Field("fp32", description="dtype of the recurrent state (float32 only)")
    # precision of float32 dots; ignored for bf16/fp16 variants
    dot_precisions: list[Literal["ieee", "tf32"]] = Field(default_factory=lambda: ["ieee"], min_length=1, description="precision of float32 dots (tf32: faster, ~1e-3 relative); ignored for bf16/fp16")


class Spec(_Strict):
    name: str = Field(pattern=NAME_PATTERN, description="package name: generated/<name>/, imported as `generated.<name>` (default: the file's stem)")
    description: str = Field("", description="one line for the generated package's docstring")
    targets: list[str] = Field(min_length=1, description="GPU archs to build for, e.g. [sm_80, sm_86]: each needs an arch profile (below)")
    variants: list[VariantAxes] = Field(min_length=1, description="groups of axes; each group's cross product is built (impossible combinations are refused, with reasons, in `dplr-gen list`)")
    # "op.stage" -> knobs, for every target; target_tuning[target]["op.stage"] overrides per target
    tuning: dict[str, Knobs] = Field(default_factory=dict, description="\"op.stage\" -> knobs for every target")
    target_tuning: dict[str, dict[str, Knobs]] = Field(default_factory=dict, description="target -> \"op.stage\" -> knobs, over `tuning` for that target")
    # then, in order, the rules whose `when` matches a variant (e.g. a narrower V tile at K = 128)
    variant_tuning: list[TuningRule] = Field(default_factory=list, description="rules applied in order after target_tuning to the variants their `when` matches")

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, targets: list[str]) -> list[str]:
        for i, t in enumerate(targets):
            try:
                get_arch(t)
            except UnknownArchError as e:
                raise LocatedError([((i,), str(e))]) from None
        if len(set(targets)) != len(targets):
            raise ValueError(f"targets repeat: {targets}")
        return targets

    @model_validator(mode="after")
    def _known_stages(self) -> "Spec":
        known = [f"{op}.{st}" for op, sts in STAGES.items() for st in sts]
        tables: list[tuple[tuple[int | str, ...], dict[str, Knobs]]] = [(("tuning",), self.tuning)] + [
            (("target_tuning", t), tab) for t, tab in self.target_tuning.items()
        ] + [(("variant_tuning", i, "tuning"), r.tuning) for i, r in enumerate(self.variant_tuning)]
        problems: list[tuple[tuple[int | str, ...], str]] = []
        for where, table in tables:
            for key, knobs in table.items():
                if key not in known:
                    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    problems.append(((*where, key), f"unknown stage {key!r}{hint} (stages: {', '.join(known)})"))
                    continue
                for knob, stages in STAGE_ONLY_KNOBS.items():
                    if getattr(knobs, knob) is not None and key not in stages:
                        problems.append(((*where, key, knob), f"only {', '.join(stages)} take the {knob} knob"))
        for t in self.target_tuning:
            if t not in self.targets:
                problems.append((("target_tuning", t), f"target {t!r} is not in targets {self.targets}"))
        for i, r in enumerate(self.variant_tuning):
            for t in r.when.get("target", []):
                if t not in self.targets:
                    problems.append((("variant_tuning", i, "when", "target"),
                                     f"names target {t!r}, not in targets {self.targets}"))
        if problems:
            raise LocatedError(problems)
        return self


def _field_path(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def _unwrap(t: Any) -> list[Any]:
    """The types an annotation may hold a value of (Optional, unions and Annotated opened)."""
    origin = get_origin(t)
    if origin is Annotated:
        return _unwrap(get_args(t)[0])
    if origin in (Union, UnionType):
        return [u for a in get_args(t) for u in _unwrap(a)]
    return [t]


def _model_at(loc: tuple[int | str, ...], model: Any = None) -> type[BaseModel] | None:
    """The model whose fields the mapping at ``loc`` of a spec holds (None where it is not a model)."""
    types: list[Any] = [model or Spec]
    for part in loc:
        nxt: list[Any] = []
        for t in types:
            origin = get_origin(t)
            if isinstance(t, type) and issubclass(t, BaseModel) and isinstance(part, str) and part in t.model_fields:
                nxt += _unwrap(t.model_fields[part].annotation)
            elif origin in (list, tuple) and isinstance(part, int):
                nxt += [u for a in get_args(t)[:1] for u in _unwrap(a)]
            elif origin is dict:
                nxt += _unwrap(get_args(t)[1])
        types = nxt
    return next((t for t in types if isinstance(t, type) and issubclass(t, BaseModel)), None)


def _unknown_key_hint(loc: tuple[int | str, ...]) -> str:
    """"did you mean" for a key the model at ``loc``'s parent does not have, and the keys it has."""
    model = _model_at(loc[:-1])
    if model is None or not isinstance(loc[-1], str):
        return ""
    keys = list(model.model_fields)
    close = difflib.get_close_matches(loc[-1], keys, n=1, cutoff=0.6)
    return (f"; did you mean {close[0]!r}?" if close else "") + f" (keys here: {', '.join(keys)}; docs/specs.md)"


# error types whose loc names a key the file lacks or should not have (not a value's union member)
_KEY_ERRORS = ("missing", "extra_forbidden")


def _field_description(loc: tuple[int | str, ...]) -> str:
    """The description of the innermost model field on ``loc`` (what the field takes), or ""."""
    for i in range(len(loc) - 1, -1, -1):
        model = _model_at(loc[:i]) if isinstance(loc[i], str) else None
        if model is not None and loc[i] in model.model_fields:
            return model.model_fields[loc[i]].description or ""
    return ""


def _error_lines(e: ValidationError, marked: yaml_marks.Marked, path: Path) -> list[str]:
    """One line per problem: file:line:column, the field, what is wrong. A value that matches no member of a
    union (e.g. head_dims' int or pair of ints) gives pydantic one error per member; those become one line saying
    what was found and what the field takes."""
    lines: list[str] = []
    unions: set[tuple[int | str, ...]] = set()
    for err in e.errors():
        loc = tuple(err["loc"])
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, LocatedError):
            lines += [_line(path, marked.where(loc + sub, key=True), loc + sub, msg) for sub, msg in cause.problems]
            continue
        value = marked.present(loc)
        if err["type"] not in _KEY_ERRORS and len(value) < len(loc):  # loc goes on into a union's members
            if value not in unions:
                unions.add(value)
                valid = _field_description(value) or "see docs/specs.md"
                lines.append(_line(path, marked.where(value), value, f"got {err.get('input')!r}; valid: {valid}"))
            continue
        unknown = err["type"] == "extra_forbidden"
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        msg = f"unknown key{_unknown_key_hint(loc)}" if unknown else f"{err['msg']}{got}"
        lines.append(_line(path, marked.where(loc, key=unknown), loc, msg))
    return lines


def _line(path: Path, mark: yaml_marks.Mark | None, loc: tuple[int | str, ...], msg: str) -> str:
    where = f"{path}:{mark.line}:{mark.column}" if mark else str(path)
    return f"  {where}: {_field_path(loc)}: {msg}"


def _name_mismatch(path: Path, name: Any, marked: yaml_marks.Marked) -> str | None:
    """The error line for a valid ``name`` that differs from the file's stem: the package is generated/<name>/, so
    a copy of ada.yaml saved as rtx4090.yaml with `name: ada` left in would overwrite ada's package."""
    stem = _stem_name(path)
    if not isinstance(name, str) or not re.match(NAME_PATTERN, name) or name == stem:
        return None
    fix = f"rename the file to {name}.yaml"
    if re.match(NAME_PATTERN, stem):
        fix = f"set `name: {stem}` (or remove the `name:` line: the stem is the default), or {fix}"
    return _line(path, marked.where(("name",)), ("name",),
                 f"{name!r} differs from the file's stem {path.stem!r}: this spec would render into "
                 f"generated/{name}/, the package of {name}.yaml. To fix it, {fix}")


def _stem_name(path: Path) -> str:
    """The package name a spec file's stem gives (its default ``name``)."""
    return re.sub(r"[^a-z0-9_]", "_", path.stem.lower())


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file; every problem is a SpecError naming the file, line, column and field."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such spec file")
    try:
        marked = yaml_marks.load(path)
    except yaml_marks.YAMLSyntaxError as e:
        raise SpecError(str(e)) from None
    raw = marked.data
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: a spec is a mapping with keys name, targets, variants (got {type(raw).__name__})")
    raw.setdefault("name", _stem_name(path))
    mismatch = _name_mismatch(path, raw["name"], marked)
    lines = [mismatch] if mismatch else []
    try:
        spec = Spec.model_validate(raw)
    except ValidationError as e:
        lines = _error_lines(e, marked, path) + lines
    if lines:
        raise SpecError("\n".join([f"{path}: invalid spec", *lines]))
    return spec
