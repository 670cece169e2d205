"""The public ops pickle by reference (dplr_gen.runtime.dispatch: BoundOp, DispatchedOp), so they can be handed to
spawned processes (torch.multiprocessing, DataLoader workers, torch.distributed launchers): a round trip gives the
module attribute back, and two spawned gloo ranks run the ops they were given as the parent does."""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dplr_gen
from dplr_gen.runtime.dispatch import BoundOp, DispatchedOp
from dplr_gen.runtime.ops import OP_NAMES
from dplr_gen.testing import rwkv7_inputs

GENERATED = Path(__file__).resolve().parent.parent / "generated"
PACKAGES = sorted(p.name for p in GENERATED.iterdir() if (p / "index.json").exists())
PROTOCOLS = range(2, pickle.HIGHEST_PROTOCOL + 1)


def test_the_shipped_packages_are_found() -> None:
    assert "ampere" in PACKAGES and len(PACKAGES) >= 2


@pytest.mark.parametrize("name", OP_NAMES)
def test_dispatched_op_round_trips(name: str) -> None:
    op = getattr(dplr_gen, name)
    assert isinstance(op, DispatchedOp)
    for protocol in PROTOCOLS:
        data = pickle.dumps(op, protocol)
        assert len(data) < 120, (protocol, len(data))  # a reference (module and name), no package state
        back = pickle.loads(data)
        assert isinstance(back, DispatchedOp) and back.__name__ == name and repr(back) == repr(op)


@pytest.mark.parametrize("package", PACKAGES)
def test_package_ops_round_trip_to_the_module_attribute(package: str) -> None:
    module = importlib.import_module(f"generated.{package}")
    for name in OP_NAMES:
        op = getattr(module, name)
        assert isinstance(op, BoundOp)
        for protocol in PROTOCOLS:
            data = pickle.dumps(op, protocol)
            assert len(data) < 120, (name, protocol, len(data))
            assert pickle.loads(data) is op  # the very attribute of generated.<package>


def test_a_pickled_op_runs_as_the_original() -> None:
    x = rwkv7_inputs(1, 5, 1, 64, seed=1)
    args = (x["q"], x["gk"], x["k"], x["v"], x["a"], x["b"])
    for op in (dplr_gen.chunk_rwkv7, importlib.import_module("generated.ampere").chunk_rwkv7):
        back = pickle.loads(pickle.dumps(op))
        o1, h1 = op(*args, initial_state=x["initial_state"], output_final_state=True)
        o2, h2 = back(*args, initial_state=x["initial_state"], output_final_state=True)
        assert torch.equal(o1, o2) and torch.equal(h1, h2)


# ----------------------------------------------------------------------------------------------------------------
# two spawned ranks (gloo, CPU, Triton's interpreter) run the ops they receive as arguments

T, H, K = 6, 1, 64


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    x = rwkv7_inputs(1, T, H, K, seed=seed)
    rate = torch.sigmoid(torch.randn(x["a"].shape, generator=torch.Generator().manual_seed(seed + 100)))
    return {"r": x["q"], "w": x["gk"], "k": x["k"], "v": x["v"], "a": x["a"], "b": x["b"], "kk": -x["a"],
            "rate": rate, "h0": x["initial_state"]}


def _run_ops(chunk: Any, fused_mul: Any, seed: int) -> torch.Tensor:
    """Both ops on the seed's inputs: their outputs and final states, flattened into one tensor."""
    x = _inputs(seed)
    o1, h1 = chunk(x["r"], x["w"], x["k"], x["v"], x["a"], x["b"], initial_state=x["h0"], output_final_state=True)
    with torch.no_grad():
        o2, h2 = fused_mul(x["r"], x["w"], x["k"], x["v"], x["kk"], x["rate"], initial_state=x["h0"],
                           output_final_state=True)
    return torch.cat([t.detach().flatten() for t in (o1, h1, o2, h2)])


def _rank(rank: int, world: int, port: int, chunk: Any, fused_mul: Any, work: str) -> None:
    out = Path(work) / f"rank{rank}.pt"
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        mine = _run_ops(chunk, fused_mul, seed=rank)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)  # each rank ends up with every rank's results
        torch.save({"results": every, "types": [type(chunk).__name__, type(fused_mul).__name__],
                    "interpret": os.environ.get("TRITON_INTERPRET")}, out)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which asserts on it
        torch.save({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_spawned_ranks_run_the_ops_they_receive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dplr_gen.chunk_rwkv7 (dispatched) and generated.ampere.fused_mul_recurrent_rwkv7 (bound to a package) go to
    2 spawned gloo ranks as arguments; each runs them on its own tiny fp32 inputs and gathers the other's: every
    result equals the parent's on the same inputs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    chunk = dplr_gen.chunk_rwkv7
    fused_mul = importlib.import_module("generated.ampere").fused_mul_recurrent_rwkv7
    mp.spawn(_rank, args=(2, _free_port(), chunk, fused_mul, str(tmp_path)), nprocs=2, join=True)
    expected = [_run_ops(chunk, fused_mul, seed=r) for r in range(2)]
    assert not torch.equal(expected[0], expected[1])  # the ranks' inputs differ
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt")
        assert "error" not in res, res.get("trace")
        assert res["types"] == ["DispatchedOp", "BoundOp"] and res["interpret"] == "1"
        assert all(torch.equal(got, want) for got, want in zip(res["results"], expected, strict=True))
