"""The public ops bound to built packages: ``generated/<spec>``'s ops (one package) and ``dplr_gen.<op>`` (the
package whose targets cover the inputs' device, found per call).

This module sits above both the loader (packages, kernels) and the ops (checks, autograd): the ops look
packages up by folder and the loader never imports the ops.
"""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path
from typing import Any

import torch

from . import ops
from . import loader
from .loader import SPEC_ENV, NotBuiltError, SpecPackage, UnsupportedDeviceError, package_at


def _public_op(module: str, name: str) -> Any:
    """The public op ``module.name`` (how an op pickled by reference is found again)."""
    return getattr(importlib.import_module(module), name)


class BoundOp:
    """A public op bound to a package: called like the op, pickled by reference, as the module attribute it is
    (``generated.<spec>.<op>``, ``dplr_gen.<op>``), so that it can be passed to a spawned process."""

    __slots__ = ("_fn", "_package", "_module", "__name__", "__qualname__")

    def __init__(self, fn: Any, package: Any, module: str, name: str) -> None:
        self._fn, self._package, self._module = fn, package, module
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, package=self._package, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return _public_op, (self._module, self.__name__)

    def __repr__(self) -> str:
        return f"<dplr-gen op {self._module}.{self.__name__}>"


class PackageOps:
    """A built package with the public ops bound to it: ``PackageOps(pkg).chunk_rwkv7(...)`` runs on ``pkg``.
    Other attributes are the package's. ``module``: the module the ops are attributes of (where pickle finds
    them)."""

    def __init__(self, package: SpecPackage, module: str | None = None) -> None:
        self.package = package
        self.module = module or f"generated.{package.name}"

    def __getattr__(self, name: str) -> Any:
        if name in ops.OP_NAMES:
            return BoundOp(getattr(ops, name), self.package, self.module, name)
        return getattr(self.package, name)


def load_package(module_name: str, init_file: str) -> PackageOps:
    """Called by generated/<spec>/__init__.py."""
    return PackageOps(package_at(Path(init_file).parent), module_name)


class _Dispatcher:
    """``dplr_gen.<op>``: picks, per call, the built package whose targets cover the inputs' device."""

    def package_for(self, device: torch.device) -> SpecPackage:
        # the answer per (device, DPLR_GEN_SPEC) is kept: listing generated/ on every op call cost ~70 us (on a CPU)
        return self._package_for(device, os.environ.get(SPEC_ENV) or None)

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one dispatcher per process (default_package)
    def _package_for(self, device: torch.device, wanted: str | None) -> SpecPackage:
        """The package for a device (errors are not kept: a later build can mend them)."""
        pkgs = loader.all_packages()  # through the module: tests replace it
        if not pkgs:
            raise NotBuiltError("no built spec under generated/: run `dplr-gen build specs/<arch>.yaml` first")
        if wanted:
            named = [p for p in pkgs if p.name == wanted]
            if not named:
                raise NotBuiltError(f"{SPEC_ENV}={wanted!r}: built specs are {', '.join(p.name for p in pkgs)}")
            return named[0]
        if device.type == "cuda":
            target = loader.device_target(device)
            for p in pkgs:
                if target in p.targets:
                    return p
            raise UnsupportedDeviceError(
                f"no built spec covers this GPU ({torch.cuda.get_device_name(device)}, {target}); built: "
                + "; ".join(f"{p.name} -> {', '.join(p.targets)}" for p in pkgs)
                + f". Write specs/<arch>.yaml with `targets: [{target}]` and run `dplr-gen build` on it"
            )
        return next((p for p in pkgs if p.name == "ampere"), pkgs[0])

    def __getattr__(self, name: str) -> Any:
        if name not in ops.OP_NAMES:
            raise AttributeError(name)
        ops._constant_result(_compiled_package_for)  # marks it for Dynamo (idempotent)
        return DispatchedOp(self, name)


class DispatchedOp:
    """``dplr_gen.<op>``: the op on the package for its inputs' device, pickled by reference."""

    __slots__ = ("_dispatcher", "_fn", "__name__", "__qualname__")

    def __init__(self, dispatcher: _Dispatcher, name: str) -> None:
        self._dispatcher, self._fn = dispatcher, getattr(ops, name)
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        q = args[0] if args else next(iter(kwargs.values()))
        # under torch.compile the lookup (a folder listing) runs once at trace time, outside the graph
        package = (_compiled_package_for(q.device) if torch.compiler.is_compiling()
                   else self._dispatcher.package_for(q.device))
        return self._fn(*args, package=package, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return _public_op, ("dplr_gen", self.__name__)

    def __repr__(self) -> str:
        return f"<dplr-gen op dplr_gen.{self.__name__}>"


@functools.cache
def default_package() -> _Dispatcher:
    return _Dispatcher()


def _compiled_package_for(device: torch.device) -> SpecPackage:
    """``dplr_gen.<op>``'s package under torch.compile. Marked as a constant result (the dispatcher marks it on
    first use), so Dynamo calls it once while tracing instead of tracing the folder listing, which it cannot:
    a graph then holds the package found for the device and DPLR_GEN_SPEC when it was traced."""
    return default_package().package_for(device)
