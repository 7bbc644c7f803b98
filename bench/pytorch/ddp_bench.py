#!/usr/bin/env python3
"""PyTorch DDP reference benchmark for distc's standard workloads.

Follows /work/shared/WORKLOADS.md (W1 sparse-lm, W2 dense-mlp): N worker
processes on this machine, gloo process group over 127.0.0.1, the model wrapped
in DistributedDataParallel, plain SGD, mean softmax cross-entropy. Worker r
draws its data with numpy's PCG64 seeded seed + r; data for warmup + steps
steps is generated before timing; warm-up steps, barrier, timed steps,
barrier; throughput = N * B * steps / elapsed (global samples/s); median of
--runs runs, each run in fresh processes. With --workers 1 the model runs in
one plain process (no process group, no DDP): the "one PyTorch process"
baseline, reported with "ddp": false. With --device cuda every worker process
puts its model and its batches on that GPU (they share it) and gloo all-reduces
the CUDA gradients through the host, as distc's `--collectives host` does.

Usage:
  .venv-bench/bin/python bench/pytorch/ddp_bench.py --workload sparse_lm --workers 2
  .venv-bench/bin/python bench/pytorch/ddp_bench.py --workload all --workers 1 2 --json
"""
import argparse
import json
import math
import os
import resource
import socket
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------- workloads

WORKLOADS = {
    # W1 sparse-lm
    "sparse_lm": dict(V=100_000, E=128, C=8, H=512, K=1000, B=256, lr=0.1, seed=1001),
    # W2 dense-mlp
    "dense_mlp": dict(D=784, H=1024, K=10, B=128, lr=0.05, seed=2001),
}


def zipf_cdf(V, s=1.1):
    """Truncated Zipf over ids 0..V-1, P(id=k) ∝ (k+1)^-s; cdf in float64."""
    p = np.arange(1, V + 1, dtype=np.float64) ** -s
    return np.cumsum(p) / p.sum()


def make_data(workload, rank, nsteps):
    """Worker `rank`'s batches for `nsteps` steps, drawn batch after batch."""
    w = WORKLOADS[workload]
    rng = np.random.Generator(np.random.PCG64(w["seed"] + rank))
    batches = []
    if workload == "sparse_lm":
        cdf = zipf_cdf(w["V"])
        for _ in range(nsteps):
            u = rng.random((w["B"], w["C"]))  # float64, row-major
            ids = np.minimum(np.searchsorted(cdf, u, side="right"), w["V"] - 1)
            labels = ids[:, w["C"] - 1] % w["K"]
            batches.append((torch.from_numpy(ids.astype(np.int64)),
                            torch.from_numpy(labels.astype(np.int64))))
    else:
        for _ in range(nsteps):
            x = rng.standard_normal((w["B"], w["D"]), dtype=np.float32)
            labels = rng.integers(0, w["K"], w["B"])
            batches.append((torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64))))
    return batches


class Dense(nn.Module):
    """y = x @ W + b with W in [in, out] layout, Glorot-uniform W, zero b."""

    def __init__(self, fan_in, fan_out):
        super().__init__()
        a = math.sqrt(6.0 / (fan_in + fan_out))
        self.weight = nn.Parameter(torch.empty(fan_in, fan_out).uniform_(-a, a))
        self.bias = nn.Parameter(torch.zeros(fan_out))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


class SparseLM(nn.Module):
    """W1: concat(emb[ids]) (8*128) -> relu(@W1+b1) (512) -> @W2+b2 (1000)."""

    def __init__(self, V, E, C, H, K, **_):
        super().__init__()
        # sparse=True: the embedding gradient is a sparse tensor (only the
        # looked-up rows); DDP all-reduces it by all-gathering with gloo, and
        # SGD updates only those rows.
        self.emb = nn.Embedding(V, E, sparse=True)
        nn.init.uniform_(self.emb.weight, -0.05, 0.05)
        self.fc1 = Dense(C * E, H)
        self.fc2 = Dense(H, K)

    def forward(self, ids):
        h0 = self.emb(ids).reshape(ids.shape[0], -1)
        return self.fc2(F.relu(self.fc1(h0)))


class DenseMLP(nn.Module):
    """W2: 784 -> relu 1024 -> relu 1024 -> 10."""

    def __init__(self, D, H, K, **_):
        super().__init__()
        self.fc1 = Dense(D, H)
        self.fc2 = Dense(H, H)
        self.fc3 = Dense(H, K)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def build_model(workload):
    w = WORKLOADS[workload]
    torch.manual_seed(w["seed"])  # same init on every rank (DDP also broadcasts rank 0's)
    return SparseLM(**w) if workload == "sparse_lm" else DenseMLP(**w)


# ---------------------------------------------------------------- one run

def worker(rank, world, port, workload, threads, warmup, steps, queue, device="cpu"):
    try:
        torch.set_num_threads(threads)
        dev = torch.device(device)
        if dev.type == "cuda":
            # "cuda" alone names no GPU, which set_device refuses: the first one then.
            if dev.index is None:
                dev = torch.device("cuda", 0)
            torch.cuda.set_device(dev)
            torch.backends.cuda.matmul.allow_tf32 = False  # fp32, as distc's default
            torch.backends.cudnn.allow_tf32 = False
        ddp = world > 1
        if ddp:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(port)
            dist.init_process_group("gloo", rank=rank, world_size=world)
        w = WORKLOADS[workload]
        data = make_data(workload, rank, warmup + steps)  # before timing
        data = [(x.to(dev), y.to(dev)) for x, y in data]
        model = build_model(workload).to(dev)
        if ddp:
            model = nn.parallel.DistributedDataParallel(
                model, device_ids=[dev.index or 0] if dev.type == "cuda" else None)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        opt = torch.optim.SGD(model.parameters(), lr=w["lr"])  # no momentum, no decay

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)  # mean over the worker's batch
            loss.backward()  # DDP: gradients averaged over workers (sum / N)
            opt.step()
            return loss

        first = None
        for i in range(warmup):
            loss = step(*data[i])
            if first is None:
                first = loss.item()
        sync()
        if ddp:
            dist.barrier()
        t0 = time.perf_counter()
        for i in range(warmup, warmup + steps):
            loss = step(*data[i])
        sync()
        if ddp:
            dist.barrier()
        elapsed = time.perf_counter() - t0
        if first is None:
            first = loss.item()
        if rank == 0:
            queue.put(("ok", elapsed, first, loss.item()))
        if ddp:
            dist.destroy_process_group()
    except BaseException as e:  # report, then fail the process
        queue.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(workload, workers, threads, warmup, steps, device="cpu"):
    """Spawn `workers` fresh processes; return (elapsed s, first loss, last loss)."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, workers, port, workload, threads, warmup, steps, queue, device))
             for r in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    results = []
    while not queue.empty():
        results.append(queue.get())
    errors = [r for r in results if r[0] == "error"]
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if errors or bad or not results:
        raise RuntimeError(f"worker failure: exit codes {[p.exitcode for p in procs]}, {errors}")
    _, elapsed, first, last = results[0]
    return elapsed, first, last


def busy_cpu_s():
    """CPU-seconds the whole machine has spent busy since boot (Linux), or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    except (OSError, ValueError):
        return None


def children_cpu_s():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", nargs="+", default=["sparse_lm"],
                    choices=["sparse_lm", "dense_mlp", "all"])
    ap.add_argument("--workers", nargs="+", type=int, default=[2], help="N (one or more)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads-per-worker", type=int, default=None,
                    help="default: cores // N (at least 1)")
    ap.add_argument("--device", default="cpu", help="cpu (default), or cuda / cuda:N: every worker on that GPU")
    ap.add_argument("--json", action="store_true",
                    help="one JSON line per configuration on stdout (progress goes to stderr)")
    args = ap.parse_args()

    workloads = ["sparse_lm", "dense_mlp"] if "all" in args.workload else args.workload
    # Single-machine runs: keep gloo on the loopback interface unless told otherwise.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

    for workload in workloads:
        for n in args.workers:
            threads = args.threads_per_worker or max(1, cores // n)
            os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the spawned workers
            B = WORKLOADS[workload]["B"]
            ddp = n > 1
            log(f"{workload}: {n} worker(s) ({'DDP, gloo' if ddp else 'one plain process, no DDP'}), "
                f"{threads} thread(s) each, B={B}/worker, {args.warmup} warm-up + {args.steps} timed steps, "
                f"{args.runs} run(s); torch {torch.__version__}, {cores} cores")
            rates = []
            losses = []
            load = os.getloadavg()[0]  # the machine may be shared: say how busy it was
            others = []
            for run in range(args.runs):
                busy0, ours0 = busy_cpu_s(), children_cpu_s()
                elapsed, first, last = one_run(workload, n, threads, args.warmup, args.steps, args.device)
                busy1, ours1 = busy_cpu_s(), children_cpu_s()
                # CPU time other processes took while this run's workers lived
                # (start-up included): a large value means the run was disturbed.
                other = None if busy0 is None else max(0.0, (busy1 - busy0) - (ours1 - ours0))
                others.append(None if other is None else round(other, 2))
                rate = n * B * args.steps / elapsed
                rates.append(rate)
                losses.append((first, last))
                log(f"  run {run + 1}: {elapsed:.3f} s, {rate:,.0f} samples/s "
                    f"(loss {first:.3f} -> {last:.3f}; other processes' CPU during the run: "
                    f"{'?' if other is None else f'{other:.2f}'} s)")
            med = statistics.median(rates)
            log(f"  median: {med:,.0f} samples/s (1-min load average before: {load:.2f}, after: {os.getloadavg()[0]:.2f})")
            if args.json:
                print(json.dumps({
                    "system": "pytorch",
                    "workload": workload,
                    "workers": n,
                    "ddp": ddp,
                    "backend": "gloo" if ddp else None,
                    "device": args.device,
                    "threads_per_worker": threads,
                    "batch_per_worker": B,
                    "warmup": args.warmup,
                    "steps": args.steps,
                    "samples_per_sec": round(med, 1),
                    "runs": [round(r, 1) for r in rates],
                    "loss_first_last": [[round(a, 4), round(b, 4)] for a, b in losses],
                    "torch": torch.__version__,
                    "cores": cores,
                    "loadavg_before": round(load, 2),
                    "other_cpu_s": others,
                }), flush=True)


if __name__ == "__main__":
    main()
