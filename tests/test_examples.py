"""The examples on CPU (Triton's interpreter, tiny sizes): examples/train_cp.py under torchrun on 2 gloo ranks
(context parallelism over packed sequences; its first-batch loss checked against one process on the whole batch),
then examples/generate.py from the weights it saved (prefill with the chunk op, decode with the state pool; no CUDA
graph on CPU), its tokens checked against the chunk op over each whole sequence."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    ckpt = tmp_path_factory.mktemp("train_cp") / "tiny.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLES / "train_cp.py"), "--device", "cpu", "--backend", "gloo", "--steps", "3", "--save", str(ckpt)],
        env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    return proc, ckpt


def test_train_cp_on_two_gloo_ranks(trained: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, ckpt = trained
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = re.findall(r"^step +(\d+) +loss (\d+\.\d+) +\((\d+) sequences, (\d) across ranks\)$", proc.stdout,
                       re.M)
    assert [int(s[0]) for s in steps] == [0, 1, 2], proc.stdout  # printed once (rank 0), every step
    assert all(0 < float(s[1]) < 10 for s in steps)
    assert int(steps[0][3]) == 1  # the checked batch has a sequence across the ranks' boundary
    assert "2 ranks (gloo, cpu), 64 tokens a batch (32 a rank)" in proc.stdout
    assert re.search(r"^check: .* match \(tolerance 1e-05\)$", proc.stdout, re.M), proc.stdout
    assert ckpt.exists()


def test_generate_from_the_trained_weights(trained: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _, ckpt = trained
    proc = subprocess.run([sys.executable, str(EXAMPLES / "generate.py"), "--device", "cpu", "--verify",
                           "--checkpoint", str(ckpt)], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "eager decode: 2 x 5 tokens" in proc.stdout
    assert "verify: the chunk op over each whole sequence agrees on 12 / 12 generated tokens" in proc.stdout
    assert "CUDA graph decode: skipped on CPU" in proc.stdout


def test_cpu_without_the_interpreter_is_refused() -> None:
    env = _env()
    env.pop("TRITON_INTERPRET")
    for script in ("generate.py", "train_cp.py"):
        proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--device", "cpu"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "set TRITON_INTERPRET=1" in proc.stderr, (script, proc.stderr[-2000:])


def test_the_model_runs_with_bf16_weights() -> None:
    """generate.py holds the model in bf16 on a GPU: every layer (the per-head norm too, which runs in fp32) must
    take bf16 weights and activations, not only the fp32 model the CPU runs use."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from tiny_rwkv7 import TimeMix
    finally:
        sys.path.remove(str(EXAMPLES))
    import torch

    mix = TimeMix(128, 64).to(torch.bfloat16)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    out = mix._finish(x, torch.randn(2, 3, 128))  # the op's output, as the fused and chunk ops return it
    assert out.dtype == torch.bfloat16 and out.shape == x.shape and torch.isfinite(out).all()
