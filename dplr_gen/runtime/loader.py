"""Loader: a built package (generated/<spec>/) and the kernels of its variants, ready to launch.

A variant's kernels come from the build's cache entries (no compile, no autotune) when the package was built
for this Triton release; otherwise Triton's JIT compiles the generated source (forbidden when
DPLR_GEN_NO_JIT=1, for production). With TRITON_INTERPRET=1 the same kernels run on CPU tensors.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..toolchain import package_kernels, settings
# (re-exported: the CLI and ondemand read them here)
from ..toolchain.package_kernels import KEEP_STUBS_ENV, keeps_stubs, load_cached_kernels  # noqa: F401
from ..plan.variant import Variant

GENERATED = Path(__file__).resolve().parents[2] / "generated"
NO_JIT_ENV = "DPLR_GEN_NO_JIT"
SPEC_ENV = "DPLR_GEN_SPEC"


class NotBuiltError(RuntimeError):
    """The package has no usable kernels for this GPU / Triton and compiling at run time is not allowed."""


class UnsupportedDeviceError(RuntimeError):
    """No target of the spec covers this GPU."""


def env_flag(name: str, default: bool) -> bool:
    """An on/off environment variable: unset -> ``default``; empty or "0" -> off; anything else -> on. dplr-gen's
    own (DPLR_GEN_*) take "1" and nothing else for on: another value is a SettingError naming the variable."""
    if name.startswith(settings.PREFIX):
        return settings.flag(name, default)
    value = os.environ.get(name)
    return default if value is None else value not in ("", "0")


def interpreting() -> bool:
    return env_flag("TRITON_INTERPRET", False)


@functools.cache
def interpreter_numpy_compat() -> None:
    """Let Triton's interpreter run ``range(n)`` over computed bounds under numpy >= 2.4.

    The interpreter (Triton 3.6) holds scalars as 1-element arrays and converts them with ``int()``, which
    numpy 2.4 refuses for arrays of ndim 1. Take the single element instead. Only used when interpreting.
    """
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def device_target(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major * 10 + minor}"


# the most registers one thread may use (sm_70 to sm_120)
MAX_REGISTERS = 255


def blocks_per_sm(regs: int, smem: int, warps: int, regs_sm: int = 65536, threads_sm: int = 2048,
                  smem_sm: int = 0) -> int:
    """Resident blocks per SM of a kernel with ``regs`` registers per thread, ``smem`` bytes of shared memory
    and ``warps`` warps per block, on an SM with the given limits (0: shared memory not limiting). Registers
    are granted per warp in units of 256; at most 32 blocks."""
    per_warp = -(-regs * 32 // 256) * 256
    n = min(regs_sm // (per_warp * warps), threads_sm // (32 * warps), 32)
    if smem and smem_sm:
        n = min(n, smem_sm // smem)
    return max(n, 0)


def _sm_limits(device: torch.device) -> dict[str, int]:
    p = torch.cuda.get_device_properties(device)
    return {"regs_sm": getattr(p, "regs_per_multiprocessor", 65536),
            "threads_sm": getattr(p, "max_threads_per_multi_processor", 2048),
            "smem_sm": getattr(p, "shared_memory_per_multiprocessor", 0)}


class KernelSet:
    """``ks.<kernel>[grid](*runtime_args)``: the constexprs and launch options come from the variant's source
    (``module``: the rendered module, or the ``LaunchTables`` the build recorded of it)."""

    def __init__(self, module: Any, aot: dict[str, Any] | None) -> None:
        self.module = module
        self.aot = aot or {}
        self._resident: dict[tuple[str, str], int | None] = {}

    def constexprs(self, name: str) -> dict[str, Any]:
        return dict(self.module.CONSTEXPRS[name])

    def arguments(self, name: str) -> Iterable[str]:
        """Kernel ``name``'s run-time argument names in launch order (its SIGNATURES entry)."""
        return self.module.SIGNATURES[name].keys()

    def warps(self, name: str) -> int:
        """Warps a program of kernel ``name`` runs (its launch options)."""
        return int(self.module.LAUNCH[name]["num_warps"])

    def option(self, name: str, default: Any = None) -> Any:
        """A host-side choice the variant's source declares (its ``OPTIONS``), else ``default``."""
        return getattr(self.module, "OPTIONS", {}).get(name, default)

    def resident_per_sm(self, name: str, device: torch.device) -> int | None:
        """How many programs of kernel ``name`` one SM of ``device`` holds at once, bound by the loaded binary's
        registers and shared memory and by its warps; None where unknown (a kernel compiled at run time)."""
        key = (name, str(device))
        if key not in self._resident:
            k = self.aot.get(name)
            res = k.resources() if k is not None else {}
            self._resident[key] = None if not res.get("n_regs") else blocks_per_sm(
                res["n_regs"], getattr(k.metadata, "shared", 0), self.module.LAUNCH[name]["num_warps"],
                **_sm_limits(device))
        return self._resident[key]

    def resident_floor(self, name: str, device: torch.device) -> int:
        """Programs of kernel ``name`` one SM of ``device`` holds at once at the most registers a thread may use
        (255) and its warps: the count its registers allow whatever its binary, for a kernel whose binary is not
        known (shared memory may allow fewer, whose programs then wait for a wave)."""
        return max(1, blocks_per_sm(MAX_REGISTERS, 0, self.module.LAUNCH[name]["num_warps"], **_sm_limits(device)))

    def has(self, name: str) -> bool:
        """Whether the variant's source declares kernel ``name`` (optional kernels, e.g. *_small_kernel)."""
        return name in self.module.SIGNATURES

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name not in self.module.SIGNATURES:
            raise AttributeError(name)
        if name in self.aot:
            return self.aot[name]
        fn = getattr(self.module, name)
        if interpreting():  # a Gluon kernel's Triton form, where the source has one (the interpreter runs no Gluon)
            fn = getattr(self.module, "TRITON_FORMS", {}).get(name, fn)
        consts, launch = self.module.CONSTEXPRS[name], self.module.LAUNCH[name]

        class _Jit:
            def __getitem__(self, grid: Any) -> Callable[..., Any]:
                return lambda *args: fn[grid](*args, **consts, **launch)

        return _Jit()


def interpreted_kernel_set(module: Any) -> KernelSet:
    """A rendered module's kernels run by Triton's interpreter (CPU tensors)."""
    from ..toolchain import interpreter_repair

    # before the first interpreted kernel: the interpreter may leave triton.language patched, and a later
    # ahead-of-time compile in this process restores it from this clean snapshot
    interpreter_repair.snapshot_language()
    interpreter_numpy_compat()
    return KernelSet(module, None)


class SpecPackage:
    """One generated/<spec>/ folder: its index, its manifest, and the kernel sets it can provide."""

    def __init__(self, directory: Path) -> None:
        settings.warn_unknown()  # once per process: a misspelt DPLR_GEN_* name would be ignored silently
        self.dir = directory
        # the ops key their caches on this string: formed once here, never by str(Path) inside a traced region
        # (dynamo cannot trace pathlib's __str__ on Python 3.12)
        self.dir_str: str = str(directory)
        self.index: dict[str, Any] = json.loads((directory / "index.json").read_text())
        self.name: str = self.index["spec"]
        self.targets: list[str] = self.index["targets"]
        self.variants: dict[str, Variant] = {
            name: Variant(**entry["params"]) for name, entry in self.index["variants"].items()
        }
        self._kernel_sets: dict[tuple[str, str], KernelSet] = {}
        # the kernels of each variant generated on demand, from whoever added it (add_variant)
        self._providers: dict[str, Callable[[SpecPackage, Variant, str], KernelSet]] = {}
        self._lock = threading.Lock()

    @property
    def variant_names(self) -> list[str]:
        return sorted(self.variants)

    @property
    def spec_file(self) -> str:
        return self.index.get("spec_file", f"specs/{self.name}.yaml")

    def manifest(self) -> dict[str, Any] | None:
        return package_kernels.read_manifest(self.dir)

    def target_for(self, device: torch.device) -> str:
        if device.type == "cpu":
            if not interpreting():
                raise UnsupportedDeviceError(
                    "dplr-gen kernels run on CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 (slow, for tests)"
                )
            return self.targets[0]
        if device.type != "cuda":
            raise UnsupportedDeviceError(f"dplr-gen kernels run on CUDA devices, got a tensor on {device}")
        target = device_target(device)
        if target not in self.targets:
            gpu = torch.cuda.get_device_name(device)
            raise UnsupportedDeviceError(
                f"this GPU ({gpu}, {target}) is not a target of spec {self.name!r} ({self.spec_file}), which "
                f"targets {', '.join(self.targets)}. Add {target} to its targets, or write specs/<arch>.yaml "
                f"with `targets: [{target}]` (and an arch profile in dplr_gen/spec/data/arches.yaml if it is new), "
                "then run `dplr-gen build` on it"
            )
        return target

    def kernel_set(self, variant: str, target: str) -> KernelSet:
        key = (variant, target)
        with self._lock:
            if key not in self._kernel_sets:
                self._kernel_sets[key] = self._load(variant, target)
            return self._kernel_sets[key]

    def add_variant(self, v: Variant, kernels: Callable[[SpecPackage, Variant, str], KernelSet]) -> str:
        """Make variant ``v`` (one generated on demand, dplr_gen.runtime.ondemand) selectable in this process; its
        name. ``kernels(package, v, target)`` provides its kernels: the loader does not import the module that
        generates them (which imports the loader)."""
        with self._lock:
            self.variants.setdefault(v.name, v)
            self._providers.setdefault(v.name, kernels)
        return v.name

    def built(self, variant: str) -> bool:
        """Whether ``variant`` is one of the package's own (its index), not generated on demand."""
        return variant in self.index["variants"]

    def _load(self, variant: str, target: str) -> KernelSet:
        if not self.built(variant):
            return self._providers[variant](self, self.variants[variant], target)
        entry = self.index["variants"][variant]["targets"][target]
        if interpreting():
            return interpreted_kernel_set(self._import_unit(entry))
        from ..toolchain import launch_stubs, triton_versions

        if self.index.get("triton_version") != str(triton_versions.triton_version()):
            # rendered for another release: its sources may lack a workaround this one needs (the registry is
            # read only here, so a prebuilt package's cold start does not import pydantic and yaml)
            _refuse_unavoided_miscompiles(entry, target, self.index["variants"][variant]["params"])
        manifest = self.manifest()
        built = not self._not_built(manifest, entry["unit"])
        # scratch memory is allocated per launch, through Triton: such a unit keeps Triton's path
        allocator = bool(entry["flags"].get("needs_allocator"))
        if allocator:
            _set_torch_allocator()
        elif built:  # launched without Triton where this machine keeps the kernels' direct records
            direct = package_kernels.direct_kernels(entry["unit"], manifest)
            if direct is not None:
                return KernelSet(*direct)
        recorded = package_kernels.recorded_kernels(entry["unit"], manifest) if built else None
        if recorded is not None:  # launched from the build's records: the rendered source is not imported
            tables, aot = recorded
            launch_stubs.warm_launchers(aot.values(), keep_in=self._stub_store(manifest))
            if not allocator:
                package_kernels.keep_direct_records(entry["unit"], manifest, aot)
            return KernelSet(tables, aot)
        module = self._import_unit(entry)
        aot, why = self._load_aot(module, entry["unit"], manifest)
        if aot is not None:
            launch_stubs.warm_launchers(aot.values(), keep_in=self._stub_store(manifest))
            return KernelSet(module, aot)
        if env_flag(NO_JIT_ENV, False):
            raise NotBuiltError(
                f"{entry['unit']} of spec {self.name!r} has no compiled kernels to load ({why}) and "
                f"{NO_JIT_ENV}=1 forbids compiling at run time; run `dplr-gen build {self.spec_file}` with the "
                "Triton release this process uses"
            )
        warnings.warn(
            f"dplr-gen: {entry['unit']}: {why}; compiling with Triton's JIT instead "
            f"(run `dplr-gen build {self.spec_file}` to load prebuilt kernels)",
            stacklevel=3,
        )
        return KernelSet(module, None)

    def prebuilt(self, variant: str, target: str) -> bool:
        """Whether the last build of this package on this machine, with this process's Triton release, compiled
        ``variant`` for ``target`` (its kernels then load without compiling)."""
        if not self.built(variant):  # generated on demand: loaded from the cache, never a manifest's
            return False
        unit = self.index["variants"][variant]["targets"].get(target, {}).get("unit")
        return not self._not_built(self.manifest(), unit)

    # the package's compiled kernels as the build wrote them (toolchain.package_kernels, shared with the build)
    _not_built = staticmethod(package_kernels.not_built)

    def build_state(self) -> str:
        """Whether the package is built here for this process's Triton release, in the words that `dplr-gen doctor`
        and the errors listing the specs under generated/ share."""
        from ..toolchain import clean, triton_versions

        manifest = self.manifest()
        if manifest is None:
            return "not built here: no manifest.json"
        built, installed = manifest.get("triton_version"), str(triton_versions.triton_version())
        if built != installed:
            return f"built here for Triton {built}, not for this process's {installed}"
        gone = len(clean.units_without_kernels(manifest))
        if gone:
            return f"built here for Triton {built}, but the kernels of {gone} of {len(manifest['units'])} units are " \
                   "gone from the cache"
        return f"built here for Triton {built}"

    def _import_unit(self, target_entry: dict[str, Any]) -> Any:
        """The rendered module of one (variant, target) entry of the index."""
        return package_kernels.unit_module(self.dir, self.name, target_entry)

    def _load_aot(self, module: Any, unit: str, manifest: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str]:
        """The unit's kernels from the cache entries ``manifest`` (this package's, as read by the caller) names,
        or None and why not."""
        return package_kernels.aot_kernels(module, unit, manifest)

    def _stub_store(self, manifest: dict[str, Any] | None) -> tuple[Path, str] | None:
        """Where launch stubs are kept beside this package's kernels (see launch_stubs.driver_modules_kept_in)."""
        return package_kernels.stub_store(manifest)

    def build_launch_stubs(self) -> int:
        """Build (or find) the launch stubs of every kernel this package's manifest names and keep them in
        dplr-gen's cache, so that a fresh process on this machine, even with an empty Triton cache, compiles
        none. Needs Triton's CUDA driver (a GPU); returns the number of kernels covered."""
        if self.manifest() is None:
            raise NotBuiltError(f"{self.dir} has no manifest.json: run `dplr-gen build {self.spec_file}` first")
        return package_kernels.build_launch_stubs(self.dir)


class KnownMiscompileError(RuntimeError):
    """The installed Triton silently miscompiles a pattern on this GPU and the generated source does not avoid it."""


def _refuse_unavoided_miscompiles(entry: dict[str, Any], target: str, params: dict[str, Any]) -> None:
    """The source was rendered for the Triton of the build; a different installed release can bring silent
    miscompiles whose workaround the source lacks. Those are refused: wrong numbers are worse than an error."""
    from ..spec import quirks
    from ..toolchain import triton_versions
    from ..spec.arch import get_arch

    installed = triton_versions.triton_version()
    avoided = set(entry.get("quirks", ()))
    for q in quirks.active_quirks(get_arch(target).cc, installed, variant=params):
        if q.effect == "miscompile" and q.id not in avoided:
            raise KnownMiscompileError(
                f"{entry['unit']}: Triton {installed} on {target} has the known silent miscompile {q.id!r} "
                f"({q.pattern}; {q.reference}), and this source was rendered without its workaround (for the "
                "Triton of the last `dplr-gen build`). Run `dplr-gen build` on the spec with this Triton, which "
                "renders the workaround, or install the Triton the package was built with"
            )


@functools.cache
def _set_torch_allocator() -> None:
    """Give Triton a device allocator for kernels that need global scratch (sm_100/sm_120 quirk)."""
    import triton

    def alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(alloc)


@functools.cache
def _package_at(directory: str) -> SpecPackage:
    return SpecPackage(Path(directory))


@functools.lru_cache(maxsize=256)
def _package_at_abs(directory: str) -> SpecPackage:
    return _package_at(str(Path(directory).resolve()))


def package_at(directory: str | Path) -> SpecPackage:
    """The package in a generated folder (one object per folder per process). The ops call this on every
    call with an absolute path: that is looked up as given, so it is resolved once, not per call (a relative
    one depends on the working directory and is resolved each time)."""
    d = str(directory)
    return _package_at_abs(d) if os.path.isabs(d) else _package_at(str(Path(d).resolve()))


def all_packages(root: Path = GENERATED, check_setting: bool = True) -> list[SpecPackage]:
    """The specs under ``root`` (folders with an index.json). With ``check_setting`` (the dispatcher's lookup), a
    SPEC_ENV naming none of them is an error listing them, each with whether it is built here."""
    pkgs = [package_at(p.parent) for p in sorted(root.glob("*/index.json"))]
    wanted = os.environ.get(SPEC_ENV)
    if check_setting and wanted and wanted not in {p.name for p in pkgs}:
        there = "; ".join(f"{p.name} ({p.build_state()})" for p in pkgs) or "none"
        raise NotBuiltError(
            f"{SPEC_ENV}={wanted!r} names no spec under {root}; the specs there: {there}. Set {SPEC_ENV} to one of "
            f"them (`dplr-gen build SPEC` adds a spec there), or unset it to use the spec whose "
            "targets cover the GPU"
        )
    return pkgs
