"""benchmarks.common.limit_autotune_configs: how gpu_check bounds fla-core's autotuning time."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_autotuners_keep_n_evenly_spaced_configs(tmp_path: Path) -> None:
    # a fresh process: the patch is process-wide and must come before the autotuned kernels are defined
    script = tmp_path / "k.py"
    script.write_text(textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        import triton
        import triton.language as tl
        from benchmarks import common as C

        C.limit_autotune_configs(3)
        configs = [triton.Config({"B": b}, num_warps=w) for b in (16, 32, 64) for w in (2, 4, 8)]

        @triton.autotune(configs=configs, key=["n"])
        @triton.jit
        def kern(x, n, B: tl.constexpr):
            pass

        @triton.autotune(configs=configs[:2], key=["n"])
        @triton.jit
        def small(x, n, B: tl.constexpr):
            pass

        print([(c.kwargs["B"], c.num_warps) for c in kern.configs], len(small.configs))
    """))
    out = subprocess.run([sys.executable, str(script), str(REPO)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[(16, 2), (32, 4), (64, 8)] 2"
