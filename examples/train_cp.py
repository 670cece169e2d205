"""Train a small RWKV-7-like language model on packed sequences of variable length with context parallelism: each
rank holds a contiguous slice of one packed batch (B = 1) and dplr_gen.chunk_rwkv7(..., cp_context=ctx) carries
the recurrence across the ranks (dplr_gen/cp.py).

    torchrun --nproc-per-node 2 examples/train_cp.py

CPU (Triton's interpreter, tiny sizes): TRITON_INTERPRET=1 torchrun --nproc-per-node 2 examples/train_cp.py --device cpu --backend gloo

Data: each step a new packed batch of sequences (lengths 1/8 to 1 x the tokens per rank, so some sequences cross
the ranks' boundaries), each an arithmetic progression mod the vocabulary with its own start and stride (1 to 8): the
next token is predictable from the two before it, so the loss falls from ln(vocab) as the model learns that. Every
rank builds the same batch from the step's seed and takes its slice; the labels (the next token of the same
sequence) are formed on the whole batch, so the last token of a slice gets its label from the next rank's first.
The model is replicated: the loss is the sum over the rank's tokens divided by the batch's labelled tokens, and
the gradients are summed over the ranks. The first batch's loss is checked against rank 0 running the whole batch
alone, without context parallelism (--no-check skips that). Build the GPU's package first (`dplr-gen build
specs/hopper.yaml`), or the first step compiles its kernels.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tiny_rwkv7, beside this file
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # dplr_gen from this checkout when not installed

from tiny_rwkv7 import TinyRWKV7  # noqa: E402

from dplr_gen.cp import build_cp_context  # noqa: E402

# sizes per device: GPUs (2 H100s: well under 2 minutes with the package built), CPU (the interpreter: seconds)
SIZES = {
    "cuda": {"vocab": 256, "hidden": 512, "layers": 4, "head_dim": 64, "tokens_per_rank": 16384, "steps": 60},
    "cpu": {"vocab": 32, "hidden": 64, "layers": 1, "head_dim": 64, "tokens_per_rank": 32, "steps": 3},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl on cuda, gloo on cpu")
    for name in ("vocab", "hidden", "layers", "head_dim", "tokens_per_rank", "steps"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default: {SIZES['cuda'][name]} on cuda, "
                                                                      f"{SIZES['cpu'][name]} on cpu")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the one-process loss check")
    ap.add_argument("--save", type=Path, help="save the trained weights here (rank 0; examples/generate.py loads them)")
    args = ap.parse_args(argv)
    for name, value in SIZES[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
        elif getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cpu" and args.backend == "nccl":
        ap.error("--backend nccl needs --device cuda")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu runs dplr-gen's kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    return args


def packed_batch(step: int, seed: int, total: int, vocab: int, shortest: int, longest: int
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(tokens [total], labels [total] (-100 at each sequence's last token), cu_seqlens) of the step's packed
    batch: arithmetic progressions mod ``vocab``, lengths drawn from [shortest, longest] (the last one cut to fit)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    cu = [0]
    while cu[-1] < total:
        cu.append(min(total, cu[-1] + int(torch.randint(shortest, longest + 1, (), generator=g))))
    tokens = torch.empty(total, dtype=torch.long)
    labels = torch.full((total,), -100, dtype=torch.long)
    for s, e in zip(cu, cu[1:]):
        start, stride = torch.randint(0, vocab, (), generator=g), torch.randint(1, 9, (), generator=g)
        tokens[s:e] = (start + stride * torch.arange(e - s)) % vocab
        labels[s:e - 1] = tokens[s + 1:e]
    return tokens, labels, cu


def loss_sum(model: TinyRWKV7, ids: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype, **kw: Any) -> torch.Tensor:
    with torch.autocast(ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits, _ = model(ids[None], **kw)
    return F.cross_entropy(logits[0].float(), labels, ignore_index=-100, reduction="sum")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dtype = torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)
    dist.init_process_group(args.backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300),
                            **({"device_id": device} if args.device == "cuda" else {}))
    say = print if rank == 0 else (lambda *a, **k: None)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = TinyRWKV7(args.vocab, args.hidden, args.layers, args.head_dim).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    T = args.tokens_per_rank
    total = T * world
    lo, hi = max(1, T // 8), T  # several sequences a rank, some across its boundaries
    say(f"{world} ranks ({args.backend}, {args.device}), {total} tokens a batch ({T} a rank), "
        f"{sum(p.numel() for p in model.parameters()):,} parameters", flush=True)

    t0 = None
    for step in range(args.steps):
        if step == 1:  # the first step loads (or compiles) the kernels: left out of the speed
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        tokens, labels, cu = packed_batch(step, args.seed, total, args.vocab, lo, hi)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        ctx = build_cp_context(cu_t.to(device), cu_seqlens_cpu=cu_t)  # global boundaries; this rank's slice
        mine = slice(rank * T, (rank + 1) * T)
        n_labels = int((labels != -100).sum())
        loss = loss_sum(model, tokens[mine].to(device), labels[mine].to(device), dtype, cp_context=ctx) / n_labels
        loss.backward()
        for p in model.parameters():  # the replicas' gradients summed: the whole batch's gradient
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total_loss = loss.detach().clone()
        dist.all_reduce(total_loss)
        across = sum(r * T not in cu for r in range(1, world))  # rank boundaries inside a sequence
        say(f"step {step:4d}  loss {total_loss.item():.4f}  ({len(cu) - 1} sequences, {across} across ranks)",
            flush=True)
        if step == 0 and args.check:
            check(model, args, rank, tokens, labels, cu, n_labels, device, dtype, total_loss.item())
    if args.device == "cuda":
        torch.cuda.synchronize()
    if t0 is not None and args.steps > 1:
        secs = time.perf_counter() - t0
        say(f"{(args.steps - 1) * total / secs:,.0f} tokens/s over {world} ranks ({secs / (args.steps - 1) * 1e3:.1f} "
            f"ms a step)", flush=True)
    if args.save is not None and rank == 0:
        torch.save({"args": {k: getattr(args, k) for k in ("vocab", "hidden", "layers", "head_dim")},
                    "model": model.state_dict()}, args.save)
        say(f"saved {args.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def check(model: TinyRWKV7, args: argparse.Namespace, rank: int, tokens: torch.Tensor, labels: torch.Tensor,
          cu: list[int], n_labels: int, device: torch.device, dtype: torch.dtype, cp_loss: float) -> None:
    """Rank 0 alone: the first batch's loss through the initial weights (rebuilt from the seed, as every rank built
    them; the trained model has taken a step since) on the whole packed batch (cu_seqlens, no context
    parallelism). It must equal the loss the ranks computed together."""
    if rank != 0:
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        ref = TinyRWKV7(args.vocab, args.hidden, args.layers, args.head_dim).to(device)
    with torch.no_grad():
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        whole = loss_sum(ref, tokens.to(device), labels.to(device), dtype, cu_seqlens=cu_t).item() / n_labels
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ok = abs(whole - cp_loss) <= tol * max(1.0, abs(whole))
    print(f"check: first batch's loss with context parallelism {cp_loss:.6f}, one process on the whole batch "
          f"{whole:.6f}: {'match' if ok else 'MISMATCH'} (tolerance {tol:g})", flush=True)


if __name__ == "__main__":
    main()
