#!/usr/bin/env python3
"""PyTorch training throughput of scripts/gpt-dsl.py's GPT, for bench/compare.sh.

The network is the exact PyTorch twin that bench/pytorch/parity.py builds (its
model_block, init_params and gpt_loss, imported from it): the same variables,
drawn from the same DSL `param` lines, and the same forward pass op for op. The
attention is therefore written out (masked softmax), not PyTorch's fused
scaled_dot_product_attention: the benchmark times the same computation on both
sides, not PyTorch's fastest kernel for it.

Training is what examples/gpt.dsl's train block runs: AdamW (lr 2e-3, betas
0.9/0.95, eps 1e-8, weight decay 0.1 on the rank >= 2 variables only, as distc's
`decay_min_rank = 2`) after clip_grad_norm_(1.0), float32, a batch of --batch
sequences of --context tokens per worker. The DSL's cosine learning-rate schedule
is left out: it changes no work per step. The ids are uniform random (int64 for
the embedding lookup; the speed does not depend on which ids they are), drawn per
worker (seed + rank) before timing, as ddp_bench.py does.

--workers 1 is one plain process (no process group, no DDP); --workers N > 1 is
DistributedDataParallel over gloo on 127.0.0.1 with N processes, each a batch of
--batch (global batch N * batch). Each process uses cores // N threads, so N
processes share the machine's cores as distc's N worker threads do. Every run
starts fresh processes (torch.multiprocessing, spawn); --warmup steps, barrier,
--steps timed steps, barrier; throughput = global batch * steps / elapsed; the
median of --runs runs. One JSON line per worker count on stdout:

  {"model": "gpt", "workers": W, "tokens_per_sec": ..., "samples_per_sec": ...,
   "step_ms": ..., ...}

with tokens = global batch * context per step; progress goes to stderr.

Usage (the environment from scripts/install-pytorch.sh):
  .venv-bench/bin/python bench/pytorch/gpt_bench.py                  # 1 and 2 workers
  .venv-bench/bin/python bench/pytorch/gpt_bench.py --workers 2 --runs 1
"""
import argparse
import importlib.util
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

HERE = Path(__file__).resolve().parent


def load_parity():
    """bench/pytorch/parity.py as a module, for its model (not its check)."""
    spec = importlib.util.spec_from_file_location("gpt_parity", HERE / "parity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Loaded at import time: spawned workers re-import this file and need gpt_loss.
parity = load_parity()


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Defaults: the size of examples/gpt.dsl.
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--vocab", type=int, default=10000)
    p.add_argument("--batch", type=int, default=16, help="sequences per worker and step")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                   help="worker counts, one case each (1: one process; N > 1: DDP, gloo)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--runs", type=int, default=3, help="runs per case; the median is reported")
    p.add_argument("--threads-per-worker", type=int, default=None, help="default: cores // N")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1, help="seeds the weights; ids use seed + rank")
    return p.parse_args()


class GPT(nn.Module):
    """parity.py's functional GPT as a module, so that DDP can wrap it: the
    variables in a ParameterDict under the DSL's names, forward = the mean loss."""

    def __init__(self, init, layers, heads):
        super().__init__()
        self.p = nn.ParameterDict({n: nn.Parameter(t) for n, t in init.items()})
        self.layers, self.heads = layers, heads

    def forward(self, tokens, targets):
        return parity.gpt_loss(self.p, tokens, targets, self.layers, self.heads)


def worker(rank, world, port, a, threads, queue):
    try:
        torch.set_num_threads(threads)
        ddp = world > 1
        if ddp:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(port)
            dist.init_process_group("gloo", rank=rank, world_size=world)
        # Same weights on every rank (DDP would broadcast rank 0's anyway).
        model = GPT(parity.init_params(parity.model_block(a), a.seed), a.layers, a.heads)
        params = list(model.parameters())
        if ddp:
            model = nn.parallel.DistributedDataParallel(model)
        # Decay only the rank >= 2 variables (matrices and the embeddings), as the
        # DSL's `decay_min_rank = 2` does.
        opt = torch.optim.AdamW([
            {"params": [q for q in params if q.dim() >= 2], "weight_decay": 0.1},
            {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0},
        ], lr=a.lr, betas=(0.9, 0.95), eps=1e-8)

        # The batches of every step before timing: generating them is not training.
        n = a.warmup + a.steps
        rng = np.random.default_rng(a.seed + rank)
        ids = lambda: torch.from_numpy(rng.integers(0, a.vocab, size=(n, a.batch, a.context)))
        tokens, targets = ids(), ids()

        def step(i):
            opt.zero_grad(set_to_none=True)
            loss = model(tokens[i], targets[i])
            loss.backward()  # DDP: gradients averaged over the workers here
            torch.nn.utils.clip_grad_norm_(params, 1.0)  # on the averaged gradient
            opt.step()
            return loss

        first = None
        for i in range(a.warmup):
            loss = step(i)
            if first is None:
                first = loss.item()
        if ddp:
            dist.barrier()
        t0 = time.perf_counter()
        for i in range(a.warmup, n):
            loss = step(i)
        if ddp:
            dist.barrier()  # the slowest worker's end
        elapsed = time.perf_counter() - t0
        last = loss.item()
        if rank == 0:
            queue.put(("ok", elapsed, first if first is not None else last, last))
        if ddp:
            dist.destroy_process_group()
    except BaseException as e:  # report, then fail the process
        queue.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(a, workers, threads):
    """`workers` fresh processes; returns (elapsed s of the timed steps, first loss, last loss)."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, workers, port, a, threads, queue))
             for r in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    results = []
    while not queue.empty():
        results.append(queue.get())
    errors = [r for r in results if r[0] == "error"]
    if errors or any(p.exitcode != 0 for p in procs) or not results:
        raise RuntimeError(f"worker failure: exit codes {[p.exitcode for p in procs]}, {errors}")
    return results[0][1:]


def log(*msg):
    print(*msg, file=sys.stderr, flush=True)


def main():
    a = parse_args()
    if a.dim % a.heads:
        sys.exit(f"gpt_bench: --dim {a.dim} is not a multiple of --heads {a.heads}")
    # Single-machine runs: keep gloo on the loopback interface unless told otherwise.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cores = os.cpu_count() or 1
    for n in a.workers:
        threads = a.threads_per_worker or max(1, cores // n)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the spawned workers
        gb = n * a.batch
        log(f"gpt ({a.layers} layers, dim {a.dim}, {a.heads} heads, context {a.context}, "
            f"vocab {a.vocab}): {n} worker(s) ({'DDP, gloo' if n > 1 else 'one process, no DDP'}), "
            f"{threads} thread(s) each, batch {a.batch}/worker, {a.warmup} warm-up + {a.steps} "
            f"timed steps, {a.runs} run(s); torch {torch.__version__}, {cores} cores")
        elapsed, losses = [], []
        load = os.getloadavg()[0]  # the machine may be shared: say how busy it was
        for run in range(a.runs):
            t, first, last = one_run(a, n, threads)
            elapsed.append(t)
            losses.append((first, last))
            log(f"  run {run + 1}: {t:.3f} s, {gb * a.context * a.steps / t:,.0f} tokens/s "
                f"(loss {first:.3f} -> {last:.3f})")
        med = statistics.median(elapsed)  # the median run's time (odd --runs)
        samples = gb * a.steps / med
        print(json.dumps({
            "model": "gpt",
            "workers": n,
            "tokens_per_sec": round(samples * a.context, 1),
            "samples_per_sec": round(samples, 2),
            "step_ms": round(1000 * med / a.steps, 2),
            "ddp": n > 1,
            "threads_per_worker": threads,
            "batch_per_worker": a.batch,
            "context": a.context,
            "warmup": a.warmup,
            "steps": a.steps,
            "runs_tokens_per_sec": [round(gb * a.context * a.steps / t, 1) for t in elapsed],
            "loss_first_last": [[round(f, 4), round(l, 4)] for f, l in losses],
            "torch": torch.__version__,
            "cores": cores,
            "loadavg_before": round(load, 2),
        }), flush=True)


if __name__ == "__main__":
    main()
