"""Direct launches (dplr_gen.toolchain.launch_direct): what Triton's runner passes to a kernel's launch stub,
captured and replayed, on CPU. The installed release's own runner and launcher object run; only the C function
at the bottom (and the device load) are stand-ins, so the test holds the replay to the release's argument list."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dplr_gen.toolchain import launch, launch_direct, probes, triton_compile, triton_versions

FUNCTION = 0xF00D  # the function handle the stand-in device load gives


class _CModule:
    """Stands in for one of Triton's C modules: a named module with a file, whose functions record calls."""

    def __init__(self, name: str, file: Path) -> None:
        self.__name__, self.__file__ = name, str(file)
        self.calls: list[tuple[Any, ...]] = []
        file.write_bytes(name.encode())

    def launch(self, *args: Any) -> None:
        self.calls.append(args)

    def load_binary(self, name: str, binary: bytes, shared: int, device: int) -> tuple[Any, ...]:
        self.calls.append((name, len(binary), shared, device))
        return ("module", FUNCTION, 40, 0, 1024)


def _loaded_probe(tmp_path: Path, stub: _CModule, scratch: int = 0) -> launch.LoadedKernel:
    """probe_add compiled for sm_90 and loaded as the runtime loads it, its device handles set as a GPU's first
    launch sets them, its launcher Triton's own class with the C function replaced."""
    import triton.backends.nvidia.driver as nv

    ok, why = triton_versions.can_target(90)
    if not ok:
        pytest.skip(why)
    sig, consts = probes.PROBES["probe_add"]
    res = triton_compile.compile_kernel(probes.probe_module().probe_add, sig, consts, 90, 4, 2)
    res.write(tmp_path / "entry")
    k = launch.load_kernel(probes.probe_module().probe_add, sig, consts, tmp_path / "entry", res.hash)
    launcher = object.__new__(nv.CudaLauncher)  # its attributes as its __init__ sets them, without a C compiler
    for attr, value in {"num_ctas": 1, "launch": stub.launch, "global_scratch_size": scratch,
                        "global_scratch_align": 1, "profile_scratch_size": 0, "profile_scratch_align": 1,
                        "launch_cooperative_grid": False, "launch_pdl": False}.items():
        setattr(launcher, attr, value)
    c = k.compiled
    c.module, c.function, c._run = "module", FUNCTION, launcher
    c.n_regs, c.n_spills, c.n_max_threads = 40, 0, 1024
    return k


@pytest.fixture
def fresh_launcher(monkeypatch) -> None:
    """The launcher a capture builds for itself: the kernel's own (no C compiler here)."""
    monkeypatch.setattr(launch_direct, "_fresh_launcher",
                        lambda c: (c._run, c._run.launch.__self__.__file__))


@pytest.fixture
def fake_driver(monkeypatch, tmp_path: Path) -> _CModule:
    import triton.runtime

    utils = _CModule("cuda_utils", tmp_path / "utils.so")
    monkeypatch.setattr(triton.runtime, "driver", SimpleNamespace(active=SimpleNamespace(
        utils=SimpleNamespace(load_binary=utils.load_binary))))
    return utils


def test_replay_passes_what_triton_passes(tmp_path: Path, fake_driver: _CModule, fresh_launcher: None,
                                         monkeypatch) -> None:
    stub = _CModule("__triton_launcher", tmp_path / "stub.so")
    k = _loaded_probe(tmp_path, stub)
    root = tmp_path / "cache"
    assert launch_direct.keep({"key1": k}, root, "9.9.9") == 1
    assert launch_direct.keep({"key1": k}, root, "9.9.9") == 0  # kept once
    assert stub.calls == []  # capturing launches nothing

    # through Triton: its runner, its launcher object, the C function
    x, y, o = object(), object(), object()
    k[(3, 2)](x, y, o, 100, stream=77)
    (through_triton,) = stub.calls
    # Triton 3.6 passes its (empty) hook chains and the metadata it makes for them; the replay passes None
    # there, for which the stub calls no hook either
    hooks = [h for h in launch_direct._hooks() if h is not None]
    assert all(launch_direct._empty_hook(h) for h in hooks)
    through_triton = tuple(None if any(a is h for h in hooks) or type(a).__name__ == "LazyDict" else a
                           for a in through_triton)

    # direct: the C module loaded from the kept copy, the stream of the current device
    modules = {"__triton_launcher": stub, "cuda_utils": fake_driver}
    monkeypatch.setattr(launch_direct, "_function", lambda path, name, fn: getattr(modules[name], fn))
    monkeypatch.setattr(launch_direct, "_current_stream", lambda: lambda: (0, 77))
    d = launch_direct.load("key1", tmp_path / "entry", root, "9.9.9")
    assert d is not None and d.n_runtime == k.n_runtime == 4 and d.metadata.name == "probe_add"
    d[(3, 2)](x, y, o, 100)
    assert stub.calls[1] == through_triton
    assert fake_driver.calls == [("probe_add", len((tmp_path / "entry" / "probe_add.cubin").read_bytes()),
                                  k.metadata.shared, 0)]  # the binary loaded once, on the current device
    d[7](x, y, o, 5, stream=9)  # a given stream; the function loaded before
    assert stub.calls[2][:5] == (7, 1, 1, 9, FUNCTION) and len(fake_driver.calls) == 1
    assert d.resources() == {"n_regs": 40, "n_spills": 0}
    with pytest.raises(TypeError, match="4 runtime arguments"):
        d[1](x, y, o)


def test_records_refused_or_missing(tmp_path: Path, fake_driver: _CModule, fresh_launcher: None) -> None:
    stub = _CModule("__triton_launcher", tmp_path / "stub.so")
    root = tmp_path / "cache"
    # scratch memory is allocated per launch: no record, the kernel keeps Triton's path
    assert launch_direct.capture(_loaded_probe(tmp_path, stub, scratch=128)) is None
    k = _loaded_probe(tmp_path, stub)
    assert launch_direct.load("key1", tmp_path / "entry", root, "9.9.9") is None  # never kept
    launch_direct.keep({"key1": k}, root, "9.9.9")
    rec = launch_direct.records_dir(root, "9.9.9")
    (mod,) = [p for p in (rec / "modules").iterdir() if p.read_bytes() == b"__triton_launcher"]
    mod.unlink()  # a part gone: not loaded from the record
    assert launch_direct.load("key1", tmp_path / "entry", root, "9.9.9") is None
    assert launch_direct.load("key1", tmp_path / "entry", root, "9.9.8") is None  # another release's


def test_launch_hooks_keep_triton_path(monkeypatch) -> None:
    import triton

    assert not launch_direct.hooks_set()
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    else:  # releases before knobs keep the hook on the compiled-kernel class
        from triton.compiler.compiler import CompiledKernel

        monkeypatch.setattr(CompiledKernel, "launch_enter_hook", lambda *a: None, raising=False)
    assert launch_direct.hooks_set()


STAND_IN_CHILD = """
import sys
from pathlib import Path
from dplr_gen.toolchain import launch_direct
stub = Path(sys.argv[1])
launch = launch_direct._function(stub, "__triton_launcher", "launch")
assert launch_direct._function(stub, "__triton_launcher", "launch") is launch  # loaded once
assert launch() == "launched" and "triton" not in sys.modules, sorted(m for m in sys.modules if "triton" in m)
assert not {"__triton_launcher", "triton", "triton.backends.nvidia.driver"} & set(sys.modules)
print("OK")
"""


def test_kept_stub_loads_without_triton(tmp_path: Path) -> None:
    """A kept stub whose initialisation imports Triton's driver module (3.6's do, for the tensor-descriptor
    type) loads without importing Triton, and leaves no module registered under its or the driver's name."""
    import subprocess
    import sys

    stub = tmp_path / "stub.py"  # a Python module standing in for the C one: the same import at load
    # (as C's PyImport_ImportModule imports: the dotted name, then its top package)
    stub.write_text("import sys\n__import__('triton.backends.nvidia.driver', fromlist=[])\n"
                    "T = sys.modules['triton.backends.nvidia.driver'].PyCUtensorMap\n"
                    "def launch():\n    return 'launched'\n")
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", STAND_IN_CHILD, str(stub)], text=True, capture_output=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(repo)}, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]
