"""Greedy generation with dplr-gen: prefill a batch of prompts with the chunk op, then decode one token at a time
with the fused recurrent op in RWKV-7's decoding form, each step replayed from a CUDA graph.

    python examples/generate.py

CPU (Triton's interpreter, tiny sizes, no graph): TRITON_INTERPRET=1 python examples/generate.py --device cpu

The decode step keeps every sequence's recurrent state in a state pool (one [slots, H, K, V] fp32 tensor per layer,
updated in place by ``fused_mul_recurrent_rwkv7(..., initial_state=pool, ssm_state_indices=slots)``), so the step
has fixed input and state buffers and no host work that waits for the device: it is captured once in a CUDA graph
and replayed per token. The same decode runs eagerly from the same prefilled states; the tokens must be identical
(same kernels, same inputs), and tokens/s of both are printed. --verify also runs the chunk op over each whole
sequence (prompt and generated tokens) and counts the positions whose greedy token agrees with the decode's (all of
them in fp32; in bf16 a near tie may differ). The model is examples/tiny_rwkv7.py's, with random weights from
--seed, or those examples/train_cp.py saved (--checkpoint).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tiny_rwkv7, beside this file
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # dplr_gen from this checkout when not installed

from tiny_rwkv7 import TinyRWKV7  # noqa: E402

SIZES = {
    "cuda": {"vocab": 256, "hidden": 512, "layers": 4, "head_dim": 64, "batch": 8, "prompt_len": 512,
             "new_tokens": 128},
    "cpu": {"vocab": 32, "hidden": 64, "layers": 1, "head_dim": 64, "batch": 2, "prompt_len": 20, "new_tokens": 6},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    for name in SIZES["cuda"]:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default: {SIZES['cuda'][name]} on cuda, "
                                                                      f"{SIZES['cpu'][name]} on cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", type=Path, help="weights saved by examples/train_cp.py --save")
    ap.add_argument("--verify", action="store_true", help="check the decode against the chunk op over each sequence")
    args = ap.parse_args(argv)
    for name, value in SIZES[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
        elif getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu runs dplr-gen's kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU here (use --device cpu with TRITON_INTERPRET=1)")
    return args


def load_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> TinyRWKV7:
    torch.manual_seed(args.seed)
    if args.checkpoint is not None:
        saved = torch.load(args.checkpoint, map_location="cpu")
        for name, value in saved["args"].items():
            setattr(args, name, value)
        model = TinyRWKV7(args.vocab, args.hidden, args.layers, args.head_dim)
        model.load_state_dict(saved["model"])
    else:
        model = TinyRWKV7(args.vocab, args.hidden, args.layers, args.head_dim)
    return model.to(device=device, dtype=dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode(step: Callable[[], torch.Tensor], ids: torch.Tensor, first: torch.Tensor, n: int
           ) -> tuple[torch.Tensor, float]:
    """n - 1 steps after the prefill's token ``first`` [B, 1]: ``step()`` reads ``ids`` and returns the next
    tokens [B, 1]. (The generated tokens [B, n], seconds.)"""
    ids.copy_(first)
    out = [first.clone()]
    sync(ids.device)
    t0 = time.perf_counter()
    for _ in range(n - 1):
        nxt = step()
        out.append(nxt.clone())
        ids.copy_(nxt)
    sync(ids.device)
    return torch.cat(out, 1), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(args, device, dtype)
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = torch.randint(0, args.vocab, (args.batch, args.prompt_len), generator=g).to(device)
    B = args.batch

    with torch.inference_mode():
        # prefill: the chunk op over the prompts, each layer's final states into its pool (slot i: sequence i)
        logits, states = model(prompts, want_states=True)
        first = logits[:, -1].argmax(-1, keepdim=True)
        pools = [s.clone() for s in states]  # [B, H, K, V] fp32 each: the pools, one slot per sequence
        prefilled = [p.clone() for p in pools]
        slots = torch.arange(B, dtype=torch.int32, device=device)  # on the device: never read by the host
        ids = torch.zeros(B, 1, dtype=torch.long, device=device)  # the step's input buffer

        def step() -> torch.Tensor:
            return model.step(ids, pools, slots).argmax(-1, keepdim=True)

        def restore() -> None:
            for p, s in zip(pools, prefilled):
                p.copy_(s)

        decode(step, ids, first, min(3, args.new_tokens))  # warm-up: the decode variant's kernels load
        restore()
        eager, eager_s = decode(step, ids, first, args.new_tokens)
        print(f"eager decode: {B} x {args.new_tokens - 1} tokens, {B * (args.new_tokens - 1) / eager_s:,.0f} tokens/s",
              flush=True)
        ok = True
        if device.type == "cuda":
            graph_tokens, graph_s = graph_decode(step, restore, ids, first, args.new_tokens)
            same = torch.equal(graph_tokens, eager)
            ok &= same
            print(f"CUDA graph decode: {B * (args.new_tokens - 1) / graph_s:,.0f} tokens/s "
                  f"({eager_s / graph_s:.2f}x eager); tokens equal to eager: {same}", flush=True)
        else:
            print("CUDA graph decode: skipped on CPU", flush=True)
        if args.verify:
            ok &= verify(model, prompts, eager, dtype)
        print("generated (first sequence):", eager[0].tolist(), flush=True)
    return 0 if ok else 1


def graph_decode(step: Callable[[], torch.Tensor], restore: Callable[[], None], ids: torch.Tensor,
                 first: torch.Tensor, n: int) -> tuple[torch.Tensor, float]:
    """One decode step captured in a CUDA graph (after warm-up steps on a side stream, as capture requires;
    they move the pools, which are put back to the prefilled states), then replayed per token."""
    ids.copy_(first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_next = step()  # recorded, not run: the pools stay as prefilled
    return decode(lambda: (graph.replay(), static_next)[1], ids, first, n)


def verify(model: TinyRWKV7, prompts: torch.Tensor, generated: torch.Tensor, dtype: torch.dtype) -> bool:
    """The chunk op over prompt + generated tokens: at each generated position the greedy token must be the one
    the decode produced (all of them in fp32)."""
    full = torch.cat([prompts, generated], 1)
    logits, _ = model(full[:, :-1])
    P = prompts.shape[1]
    again = logits[:, P - 1:].argmax(-1)
    agree = int((again == generated).sum())
    total = generated.numel()
    print(f"verify: the chunk op over each whole sequence agrees on {agree} / {total} generated tokens", flush=True)
    return agree == total or dtype != torch.float32


if __name__ == "__main__":
    sys.exit(main())
