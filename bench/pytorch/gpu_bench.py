#!/usr/bin/env python3
"""PyTorch on one GPU, for distc's single-GPU benchmark.

The same two models, batches, optimizer (plain SGD) and learning rates as
ddp_bench.py and examples/{sparse_lm,dense_mlp}.dsl (WORKLOADS.md W1, W2), and
the same data stream (numpy PCG64, seed 1001 / 2001, worker 0), all of it moved
to the device before timing (as `distc train --preload` does). fp32 throughout,
TF32 off for matrix products and cuDNN.

Modes:
  eager    the model of ddp_bench.py as it is, one Python step per batch.
  graphs   the whole training step (forward, backward, optimizer.step) captured
           once with torch.cuda.graph after 3 eager warm-up steps on a side
           stream; the other warm-up steps and the timed steps are replays, each
           step's batch copied into the static input tensors first.
  compile  torch.compile(mode="reduce-overhead") on the model and on the
           optimizer step (CUDA graphs made by Inductor).

The embedding gradient (sparse_lm). distc updates only the rows a batch
touched; ddp_bench.py does the same with nn.Embedding(sparse=True), whose
gradient is a sparse tensor that SGD adds into the touched rows. That update
coalesces the sparse gradient, which reads its row count back to the host, so
it cannot be captured in a CUDA graph. --emb-grad chooses:
  sparse  nn.Embedding(sparse=True) (as ddp_bench.py);
  dense   nn.Embedding(sparse=False): a dense 100000x128 gradient and an SGD
          update of the whole table (the same result for plain SGD, more
          memory traffic) -- what stock PyTorch can capture;
  rows    the embedding gradient taken as the gradient of the gathered rows and
          added into the table with index_add_(-lr): the sparse update, in
          fixed shapes, capturable (hand-written, not torch.optim).
  auto    (default) sparse in eager mode; in graphs mode sparse if a probe in a
          child process can capture and replay it, else dense; dense in compile.
Every JSON line says which one ran (`emb_grad`) and why (`emb_grad_note`).

Measurement: warm-up steps, torch.cuda.synchronize, timed steps with a CUDA
event before each step and after the last, synchronize. samples/s =
B * steps / (wall time of the timed steps); `step_ms_median` from the events;
`samples_per_sec_median_step` = B / median step (the figure `distc train
--metrics` gives, median over steps). Median over --runs runs (each a fresh
model, optimizer and graph in this process). Peak memory:
torch.cuda.max_memory_allocated over the run (the preloaded batches included;
`data_bytes` says how much they take).

Correctness: every configuration other than eager with ddp_bench.py's model
first trains 4 steps from the same weights as eager PyTorch does and reports
`check_vs_eager` (largest max|a-b|/max|a| over the variables; ok at <= 1e-4).

One JSON line per (workload, mode) on stdout (`error` when it failed; the exit
status is then 1); progress on stderr.

Usage:
  python3 bench/pytorch/gpu_bench.py --workload all --mode eager graphs
  python3 bench/pytorch/gpu_bench.py --device cpu --mode eager --warmup 1 --steps 2 --runs 1
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_bench import WORKLOADS, build_model, make_data  # noqa: E402  (the same models and data)

MODES = ["eager", "graphs", "compile"]
EMB_GRADS = ["auto", "sparse", "dense", "rows"]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def fp32_only():
    """fp32 matrix products and convolutions: TF32 off (the PyTorch default for matmul)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 2.9+: the allow_tf32 flags are deprecated, still honoured
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def tf32_state():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                "float32_matmul_precision": torch.get_float32_matmul_precision()}


# ---------------------------------------------------------------- the step

# --amp bf16: each forward pass (and so its backward) under torch.autocast in bfloat16,
# the weights and the optimizer in fp32: PyTorch's mixed precision, beside distc's
# --precision bf16. The weight cache is off so that a captured graph recasts the
# weights on every replay, as each step must.
AMP = "fp32"


def amp():
    if AMP == "bf16":
        return torch.autocast(device_type="cuda" if torch.cuda.is_available() else "cpu",
                              dtype=torch.bfloat16, cache_enabled=False)
    return contextlib.nullcontext()


class RowsEmbeddingSGD:
    """sparse_lm with the embedding's gradient kept as the gradient of the gathered
    rows and applied as emb.index_add_(ids, -lr * grad_rows): SGD on the touched
    rows only, every shape fixed, so it can be captured. The dense layers train
    with torch.optim.SGD as usual."""

    def __init__(self, model, lr):
        self.model, self.lr = model, lr
        model.emb.weight.requires_grad_(False)
        self.opt = torch.optim.SGD([p for n, p in model.named_parameters() if n != "emb.weight"], lr=lr)

    def step(self, ids, y):
        m = self.model
        rows = m.emb.weight[ids].requires_grad_(True)  # [B, C, E], a leaf
        with amp():
            logits = m.fc2(F.relu(m.fc1(rows.reshape(ids.shape[0], -1))))
            loss = F.cross_entropy(logits, y)
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            m.emb.weight.index_add_(0, ids.reshape(-1), rows.grad.reshape(-1, rows.shape[-1]), alpha=-self.lr)
        return loss


def make_trainer(workload, emb_grad, device):
    """(model, step(x, y) -> loss, zero_grad()) for one run."""
    w = WORKLOADS[workload]
    model = build_model(workload).to(device)
    if workload == "sparse_lm" and emb_grad == "rows":
        t = RowsEmbeddingSGD(model, w["lr"])
        return model, t.step, lambda: t.opt.zero_grad(set_to_none=True)
    if workload == "sparse_lm":
        model.emb.sparse = emb_grad == "sparse"  # nn.Embedding reads .sparse in forward
    opt = torch.optim.SGD(model.parameters(), lr=w["lr"])  # no momentum, no decay

    def step(x, y):
        with amp():
            loss = F.cross_entropy(model(x), y)  # mean over the batch
        loss.backward()
        opt.step()
        return loss

    return model, step, lambda: opt.zero_grad(set_to_none=True)


def make_compiled(workload, emb_grad, device):
    w = WORKLOADS[workload]
    model = build_model(workload).to(device)
    if workload == "sparse_lm":
        model.emb.sparse = emb_grad == "sparse"
    opt = torch.optim.SGD(model.parameters(), lr=w["lr"])

    @torch.compile(mode="reduce-overhead")
    def forward_loss(x, y):
        with amp():
            return F.cross_entropy(model(x), y)

    @torch.compile(mode="reduce-overhead")
    def opt_step():
        opt.step()

    def step(x, y):
        torch.compiler.cudagraph_mark_step_begin()
        loss = forward_loss(x, y)
        loss.backward()
        opt_step()
        return loss.detach().clone()  # the graph's output is overwritten by the next replay

    return model, step, lambda: opt.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- one run

def one_run(workload, mode, emb_grad, data, warmup, steps, device):
    """Train warmup + steps steps on `data` (device tensors); return a dict of timings."""
    cuda = device.type == "cuda"
    B = WORKLOADS[workload]["B"]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses = []

    if mode == "graphs":
        model, step, zero_grad = make_trainer(workload, emb_grad, device)
        static_x = data[0][0].clone()
        static_y = data[0][1].clone()
        # Warm-up on a side stream (the documented whole-network capture recipe): the
        # first min(3, warmup) batches, eagerly, so that lazily made state (cuBLAS
        # workspaces, autograd buffers) exists before capture; the rest of the
        # warm-up steps are replays.
        n_eager = min(3, warmup)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(n_eager):
                zero_grad()
                static_x.copy_(data[i][0])
                static_y.copy_(data[i][1])
                losses.append(step(static_x, static_y).detach())
        torch.cuda.current_stream().wait_stream(side)
        # Capture: gradients are None now, so backward in the graph writes (not
        # accumulates) them into the graph's own pool, and every replay does the same.
        zero_grad()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = step(static_x, static_y)

        def run_step(i):
            static_x.copy_(data[i][0])
            static_y.copy_(data[i][1])
            graph.replay()
            return static_loss.detach().clone()

        for i in range(n_eager, warmup):
            losses.append(run_step(i))
        first_timed = warmup
    else:
        if mode == "compile":
            model, step, zero_grad = make_compiled(workload, emb_grad, device)
        else:
            model, step, zero_grad = make_trainer(workload, emb_grad, device)

        def run_step(i):
            zero_grad()
            return step(*data[i]).detach()

        for i in range(warmup):
            losses.append(run_step(i))
        first_timed = warmup

    if cuda:
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    marks = []
    t0 = time.perf_counter()
    for k in range(steps):
        if cuda:
            events[k].record()
        else:
            marks.append(time.perf_counter())
        losses.append(run_step(first_timed + k))
    if cuda:
        events[steps].record()
        torch.cuda.synchronize()
    else:
        marks.append(time.perf_counter())
    elapsed = time.perf_counter() - t0
    if cuda:
        step_ms = [events[k].elapsed_time(events[k + 1]) for k in range(steps)]
    else:
        step_ms = [(marks[k + 1] - marks[k]) * 1e3 for k in range(steps)]
    med = statistics.median(step_ms)
    return {
        "samples_per_sec": B * steps / elapsed,
        "samples_per_sec_median_step": B / (med / 1e3),
        "step_ms_median": med,
        "step_ms_min": min(step_ms),
        "step_ms_max": max(step_ms),
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "loss_first_last": [float(losses[0]), float(losses[-1])],
        "model": model,
    }


def check_against_eager(workload, mode, emb_grad, data, device, warmup=2, steps=2):
    """Train warmup + steps steps from the same initial weights with `mode` and with
    eager PyTorch (the sparse gradient of ddp_bench.py); return the largest over the
    variables of max |a - b| / max |a| (distc verify's measure)."""
    ref = one_run(workload, "eager", "sparse" if workload == "sparse_lm" else None,
                  data, warmup, steps, device)["model"].state_dict()
    got = one_run(workload, mode, emb_grad, data, warmup, steps, device)["model"].state_dict()
    worst = 0.0
    for name, a in ref.items():
        b = got[name]
        worst = max(worst, ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item())
    return worst


# ---------------------------------------------------------------- sparse capture probe

PROBE = "--probe-sparse-capture"
CHECK_TOLERANCE = 1e-4  # as distc verify's default


def probe_sparse_capture():
    """In a child process: can the sparse-gradient step be captured and replayed?
    (A failed capture can leave the CUDA context unusable, so not in this process.)"""
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), PROBE],
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"probe did not run: {e}"
    if r.returncode == 0:
        return True, "sparse embedding gradient captured and replayed"
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    return False, lines[-1] if lines else f"probe exited with {r.returncode}"


def probe_main():
    fp32_only()
    device = torch.device("cuda")
    data = [(x.to(device), y.to(device)) for x, y in make_data("sparse_lm", 0, 4)]
    err = check_against_eager("sparse_lm", "graphs", "sparse", data, device)
    if not err <= CHECK_TOLERANCE:
        raise RuntimeError(f"captured sparse step differs from eager: relative error {err:.2e}")
    print(f"ok: relative error {err:.2e}", flush=True)


# ---------------------------------------------------------------- main

def choose_emb_grad(workload, mode, asked, cache):
    if workload != "sparse_lm":
        return None, None
    if asked != "auto":
        return asked, "as asked (--emb-grad)"
    if mode == "eager":
        return "sparse", "nn.Embedding(sparse=True), as ddp_bench.py"
    if mode == "compile":
        return "dense", "nn.Embedding(sparse=False): torch.compile does not take sparse gradients"
    if "graphs" not in cache:
        cache["graphs"] = probe_sparse_capture()
    ok, why = cache["graphs"]
    if ok:
        return "sparse", why
    return "dense", ("the sparse gradient's SGD update cannot be captured "
                     f"({why}); nn.Embedding(sparse=False) instead: a dense gradient and a "
                     "whole-table update, the same result for plain SGD")


def main():
    if len(sys.argv) == 2 and sys.argv[1] == PROBE:
        probe_main()
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", nargs="+", default=["all"], choices=["sparse_lm", "dense_mlp", "all"])
    ap.add_argument("--mode", nargs="+", default=["eager", "graphs"], choices=MODES)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--emb-grad", default="auto", choices=EMB_GRADS,
                    help="sparse_lm's embedding gradient (see above; default auto)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--amp", default="fp32", choices=["fp32", "bf16"],
                    help="bf16: forward passes under torch.autocast(bfloat16), fp32 weights (default fp32)")
    args = ap.parse_args()
    global AMP
    AMP = args.amp
    if args.runs < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--runs and --steps must be at least 1, --warmup at least 0")

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        refused = [m for m in args.mode if m != "eager"]
        if refused:
            ap.error(f"--mode {' '.join(refused)} needs a CUDA device (CUDA graphs); "
                     f"on {device.type} only --mode eager runs")
    elif not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device "
                 f"(torch.version.cuda = {torch.version.cuda}); use --device cpu --mode eager")
    if "graphs" in args.mode and args.warmup < 1:
        ap.error("--mode graphs needs --warmup of at least 1 (the warm-up before capture)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if cuda and device.index is not None:
        torch.cuda.set_device(device.index)
    fp32_only()

    workloads = ["sparse_lm", "dense_mlp"] if "all" in args.workload else args.workload
    name = torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    log(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {name}; fp32, {tf32_state()}")
    probe_cache = {}
    failed = 0
    for workload in workloads:
        w = WORKLOADS[workload]
        nsteps = max(args.warmup + args.steps, 4)  # at least the 4 steps of the check
        host = make_data(workload, 0, nsteps)  # worker 0's stream, before timing
        data = [(x.to(device), y.to(device)) for x, y in host]
        data_bytes = sum(x.numel() * x.element_size() + y.numel() * y.element_size() for x, y in data)
        for mode in args.mode:
            emb_grad, note = choose_emb_grad(workload, mode, args.emb_grad, probe_cache)
            log(f"{workload} {mode}: B={w['B']}, SGD lr {w['lr']}, {args.warmup} warm-up + {args.steps} timed "
                f"steps, {args.runs} run(s)" + (f"; embedding gradient {emb_grad}: {note}" if emb_grad else ""))
            line = {"system": "pytorch", "workload": workload, "mode": mode, "device": str(device),
                    "device_name": name, "batch": w["B"], "lr": w["lr"], "precision": args.amp,
                    **tf32_state(), "emb_grad": emb_grad, "emb_grad_note": note,
                    "warmup": args.warmup, "steps": args.steps, "torch": torch.__version__}
            try:
                if mode != "eager" or emb_grad not in (None, "sparse"):
                    # Same weights as eager PyTorch after 4 steps? (A capture that
                    # replays something else would be fast and wrong.)
                    err = check_against_eager(workload, mode, emb_grad, data[:4], device)
                    line["check_vs_eager"] = {"steps": 4, "max_rel_err": err, "ok": err <= CHECK_TOLERANCE}
                    log(f"  against eager after 4 steps: relative error {err:.2e}"
                        + ("" if err <= CHECK_TOLERANCE else f" -- ABOVE {CHECK_TOLERANCE:.0e}"))
                runs = []
                for run in range(args.runs):
                    r = one_run(workload, mode, emb_grad, data, args.warmup, args.steps, device)
                    del r["model"]
                    runs.append(r)
                    log(f"  run {run + 1}: {r['samples_per_sec']:,.0f} samples/s, step median "
                        f"{r['step_ms_median']:.3f} ms, loss {r['loss_first_last'][0]:.3f} -> "
                        f"{r['loss_first_last'][1]:.3f}"
                        + (f", peak {r['peak_bytes'] / 2**20:.1f} MiB" if r["peak_bytes"] is not None else ""))
                    if cuda:
                        torch.cuda.empty_cache()
                best = sorted(runs, key=lambda r: r["samples_per_sec"])[len(runs) // 2]  # the median run
                line.update({
                    "samples_per_sec": round(best["samples_per_sec"], 1),
                    "samples_per_sec_median_step": round(best["samples_per_sec_median_step"], 1),
                    "step_ms_median": round(best["step_ms_median"], 4),
                    "step_ms_min": round(best["step_ms_min"], 4),
                    "step_ms_max": round(best["step_ms_max"], 4),
                    "runs": [round(r["samples_per_sec"], 1) for r in runs],
                    "peak_mem_bytes": max((r["peak_bytes"] or 0) for r in runs) if cuda else None,
                    "data_bytes": data_bytes,
                    "loss_first_last": [round(v, 4) for v in best["loss_first_last"]],
                })
            except Exception as e:  # report it, go on with the next configuration
                failed += 1
                line["error"] = f"{type(e).__name__}: {e}"
                log(f"  FAILED: {line['error']}")
            print(json.dumps(line), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
