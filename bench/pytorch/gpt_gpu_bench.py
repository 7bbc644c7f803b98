#!/usr/bin/env python3
"""PyTorch training throughput of scripts/gpt-dsl.py's GPT on one GPU, beside distc's.

The default size is GPT-2 124M (12 layers, width 768, 12 heads, context 1024,
vocabulary 50304, the multiple of 64 nanoGPT pads 50257 to). The network is
bench/pytorch/parity.py's exact PyTorch twin of the DSL (imported from it, as
gpt_bench.py does): the variables are drawn by parity.init_params from the `param`
lines of the DSL text that scripts/gpt-dsl.py writes for these sizes, so names,
shapes and initialisers cannot drift from what distc compiles.

Modes (--modes, default `eager compiled`):
  written   parity.gpt_loss as it is: attention written out as a masked softmax,
            eager. (Its causal mask is made with torch.ones, on the CPU unless a
            device is the default, so the call runs inside `with torch.device(...)`;
            that context intercepts every torch call in Python: a few microseconds
            per op.)
  eager     the same model and weights with the attention through
            F.scaled_dot_product_attention(q, k, v, is_causal=True), eager. On CUDA
            in bf16 it is pinned to the flash-attention backend
            (torch.nn.attention.sdpa_kernel), so a silent fallback to the math
            kernel cannot pass for PyTorch's speed: it fails instead.
  compiled  `eager` under torch.compile (default mode): Inductor's fused kernels
            around the same flash attention. Compilation happens in the warm-up
            steps, which are not timed.
sdpa_loss below is gpt_loss with only the attention changed; --self-test checks on
the CPU in f32 that its loss equals parity.gpt_loss's within 1e-5 relative (and its
gradients within 1e-4 of each variable's largest), the evidence that `eager` and
`compiled` train the model that `written` and distc train.

Precision. bf16 (the default): f32 master weights and optimizer state on the GPU;
the forward pass and the loss under torch.autocast(bfloat16), backward outside it
(autocast's usual recipe), so matrix products and attention run in bf16 and what
autocast keeps in f32 (layer norms, softmax, the cross-entropy, and the bias adds,
which promote `x @ W` back to f32 as parity.gpt_loss writes them) stays f32. TF32 is
allowed for matrix products left in f32 (torch.backends.cuda.matmul.allow_tf32 =
True); under autocast there are none in this model, so it changes nothing measured.
f32: no autocast and TF32 off: true f32, the precision of distc's f32 runs.

Training is the DSL train block's step, its learning-rate schedule left out (it
changes no work): AdamW (--lr, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on the
rank >= 2 variables only, distc's `decay_min_rank = 2`; fused=True on CUDA) after
clip_grad_norm_(1.0) (`clip_norm = 1.0`) every step. Data: uniform random ids in
[0, vocab), int64, tokens and targets drawn independently (as parity.py's random
batches) from a seeded torch.Generator before anything is timed: a pool of 8
batches on the device, step i reading batch i mod 8.

Measurement. Each mode builds the model and optimizer from the same initial
weights, runs --warmup steps, then --runs windows of --steps timed steps, each
window between two torch.cuda.synchronize() calls, timed with perf_counter.
tokens/s = batch * context * steps / elapsed of a window; the median window is
reported (training continues across windows: the work per step is the same).
`first_loss` is step 1's loss, before any update (about ln(vocab) at this
initialisation; the modes differ there only by rounding). `peak_memory_bytes` is
torch.cuda.max_memory_allocated over the mode: weights, AdamW state, gradients,
activations and the batch pool.

MFU. Model FLOPs per token, as PaLM (appendix B) and nanoGPT's estimate_mfu count
them: 6 N + 12 L H d_head T, where N counts the parameters without the position
embedding (the tied token embedding counted once: it is the output projection's
matrix) and the second term is attention's two score/value products, forward and
backward, over the full T x T matrix even though the causal mask makes half of it
unused (as nanoGPT counts; a kernel that skips the masked half does less work than
credited). model_flops_per_sec = that * tokens/s; mfu = model_flops_per_sec /
peak, the peak from --peak-tflops or else from the device name: dense bf16 989.4
TFLOP/s for the H100 SXM ("HBM3" in its name) and the H200, 312 for the A100; true
f32 (no TF32) 67 and 19.5. Any other device: peak "unknown", mfu null.

Output: one JSON line per mode on stdout (also appended to --out FILE):

  {"impl": "pytorch", "mode": "eager", "device": "NVIDIA H100 80GB HBM3",
   "precision": "bf16", "batch": 8, "context": 1024, "tokens_per_sec": ...,
   "step_ms": ..., "first_loss": ..., "peak_memory_bytes": ...,
   "model_flops_per_sec": ..., "mfu": ..., "torch": "2.11.0+cu130", ...}

A mode that fails prints its line with "error" and the next mode runs; the exit
status is 1 only when every mode failed, 2 on a setup error (no CUDA device for
--device cuda). Progress goes to stderr.

Usage (on the GPU machine, PyTorch's own python3; here .venv-bench from
scripts/install-pytorch.sh):
  python3 bench/pytorch/gpt_gpu_bench.py                         # 124M, bf16, eager + compiled
  python3 bench/pytorch/gpt_gpu_bench.py --modes written eager compiled --runs 3 --out gpt.jsonl
  python3 bench/pytorch/gpt_gpu_bench.py --self-test             # CPU: sdpa_loss == parity.gpt_loss
  python3 bench/pytorch/gpt_gpu_bench.py --device cpu --layers 2 --dim 64 --heads 4 \\
      --context 32 --vocab 100 --batch 2 --warmup 1 --steps 2 --precision f32
"""
import argparse
import contextlib
import gc
import importlib.util
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
MODES = ["written", "eager", "compiled"]
POOL = 8  # distinct batches, cycled through
LOSS_RTOL = 1e-5  # --self-test: sdpa_loss against parity.gpt_loss, f32
GRAD_RTOL = 1e-4  # --self-test: per variable, max|dg| / max|g|


def load_parity():
    """bench/pytorch/parity.py as a module, for its model (not its check)."""
    spec = importlib.util.spec_from_file_location("gpt_parity", HERE / "parity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


parity = load_parity()


def log(*msg):
    print(*msg, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--warmup", type=int, default=10,
                   help="untimed steps first (compilation happens here)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--runs", type=int, default=1,
                   help="timed windows of --steps after one warm-up; the median is reported")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["eager", "compiled"])
    p.add_argument("--precision", choices=["bf16", "f32"], default="bf16",
                   help="bf16: autocast over f32 weights (default); f32: true f32, TF32 off")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=1, help="seeds the weights and the batches")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a smoke run at a tiny size (default cuda)")
    p.add_argument("--peak-tflops", type=float,
                   help="the device's peak for --precision, for mfu (default: a table by "
                        "device name)")
    p.add_argument("--out", metavar="FILE", help="also append the JSON lines to FILE")
    p.add_argument("--self-test", action="store_true",
                   help="CPU, f32: check sdpa_loss against parity.gpt_loss and the "
                        "parameter count, then exit")
    a = p.parse_args(argv)
    if a.dim % a.heads:
        p.error(f"--dim {a.dim} is not a multiple of --heads {a.heads}")
    if min(a.layers, a.dim, a.heads, a.context, a.vocab, a.batch, a.steps, a.runs) < 1:
        p.error("sizes, --batch, --steps and --runs must be at least 1")
    if a.warmup < 0:
        p.error("--warmup must be at least 0")
    if "compiled" in a.modes and a.warmup < 1:
        p.error("--modes compiled needs --warmup of at least 1: its first step compiles")
    return a


# ---------------------------------------------------------------- the model


def sdpa_loss(p, tokens, targets, layers, heads):
    """parity.gpt_loss with the attention through scaled_dot_product_attention
    (is_causal=True, its default scale 1/sqrt(d_head), as gpt_loss divides by):
    every other op as gpt_loss writes it, so both compute one function."""
    B, T = tokens.shape
    V, C = p["wte"].shape
    D = C // heads

    def split(y):
        return y.reshape(B, T, heads, D).transpose(1, 2)

    x = F.embedding(tokens, p["wte"]) + p["wpe"]
    for i in range(layers):
        w = lambda n: p[f"h{i}_{n}"]
        a = F.layer_norm(x, (C,), w("ln1_g"), w("ln1_b"), parity.LN_EPS)
        q, k, v = split(a @ w("wq") + w("bq")), split(a @ w("wk")), split(a @ w("wv") + w("bv"))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, C)
        r = x + y @ w("wo") + w("bo")
        m = F.layer_norm(r, (C,), w("ln2_g"), w("ln2_b"), parity.LN_EPS)
        x = r + F.gelu(m @ w("wfc") + w("bfc"), approximate="tanh") @ w("wproj") + w("bproj")
    f = F.layer_norm(x, (C,), p["lnf_g"], p["lnf_b"], parity.LN_EPS)
    logits = f @ p["wte"].t()
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def written_loss(p, tokens, targets, layers, heads):
    """parity.gpt_loss unchanged; its causal mask is made on the tokens' device."""
    with torch.device(tokens.device):
        return parity.gpt_loss(p, tokens, targets, layers, heads)


class Gpt(nn.Module):
    """The functional GPT as a module (for torch.compile and .parameters()): the
    variables in a ParameterDict under the DSL's names, forward = the mean loss."""

    def __init__(self, init, layers, heads, loss_fn):
        super().__init__()
        self.p = nn.ParameterDict({n: nn.Parameter(t) for n, t in init.items()})
        self.layers, self.heads, self.loss_fn = layers, heads, loss_fn

    def forward(self, tokens, targets):
        return self.loss_fn(self.p, tokens, targets, self.layers, self.heads)


def model_text(a):
    return parity.model_block(SimpleNamespace(layers=a.layers, dim=a.dim, heads=a.heads,
                                              context=a.context, vocab=a.vocab))


def param_shapes(text):
    """{name: shape} of the DSL text's `param` lines (parity.init_params' reading),
    without drawing the values."""
    shapes = {}
    for line in text.splitlines():
        m = parity.PARAM.match(line.split("#")[0])
        if m:
            shapes[m.group(1)] = [int(d) for d in m.group(2).split(",")]
    return shapes


def flops_per_token(shapes, layers, heads, dim, context):
    """(6 N + 12 L H d_head T, N): N without the position embedding `wpe`."""
    n = sum(math.prod(s) for name, s in shapes.items() if name != "wpe")
    return 6 * n + 12 * layers * heads * (dim // heads) * context, n


# Dense peaks in TFLOP/s by precision: (test on the device name, peak, what it is).
PEAKS = {
    "bf16": [
        (lambda n: "H100" in n and ("HBM3" in n or "SXM" in n), 989.4, "H100 SXM dense bf16"),
        (lambda n: "H200" in n, 989.4, "H200 dense bf16"),
        (lambda n: "A100" in n, 312.0, "A100 dense bf16"),
    ],
    "f32": [
        (lambda n: "H100" in n and ("HBM3" in n or "SXM" in n), 67.0, "H100 SXM f32, no TF32"),
        (lambda n: "H200" in n, 67.0, "H200 f32, no TF32"),
        (lambda n: "A100" in n, 19.5, "A100 f32, no TF32"),
    ],
}


def peak_tflops(a, name):
    """(peak TFLOP/s or None, where it came from)."""
    if a.peak_tflops:
        return a.peak_tflops, "--peak-tflops"
    for test, peak, what in PEAKS[a.precision]:
        if test(name):
            return peak, what
    return None, "unknown"


# ---------------------------------------------------------------- one mode


def set_tf32(on):
    """TF32 for f32 matrix products: on under bf16 (the f32 parts), off for f32."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 2.9+: the allow_tf32 flags are deprecated, still honoured
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on


def contexts(a, device, mode):
    """(autocast context, attention-backend context, attention description)."""
    cuda = device.type == "cuda"
    amp = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if a.precision == "bf16" \
        else contextlib.nullcontext
    if mode == "written":
        return amp, contextlib.nullcontext, "written (masked softmax)"
    if cuda and a.precision == "bf16":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return amp, (lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)), "sdpa (flash only)"
    return amp, contextlib.nullcontext, "sdpa (PyTorch's choice of backend)"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_mode(a, mode, init, pool, device):
    """Trains warmup + runs * steps steps in `mode`; returns the measurements."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    amp, attn, attention = contexts(a, device, mode)
    model = Gpt({n: t.to(device, copy=True) for n, t in init.items()}, a.layers, a.heads,
                written_loss if mode == "written" else sdpa_loss)
    params = list(model.parameters())
    # Decay only the rank >= 2 variables (matrices and the embeddings), as the DSL's
    # `decay_min_rank = 2` does.
    opt = torch.optim.AdamW([
        {"params": [q for q in params if q.dim() >= 2], "weight_decay": 0.1},
        {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0},
    ], lr=a.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if cuda else {}))
    forward = torch.compile(model) if mode == "compiled" else model

    def step(i):
        tokens, targets = pool[i % len(pool)]
        opt.zero_grad(set_to_none=True)
        with amp(), attn():
            loss = forward(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.detach()

    i = 0
    first = None
    t0 = time.perf_counter()
    for _ in range(a.warmup):
        loss = step(i)
        if i == 0:
            first = loss
        i += 1
    sync(device)
    if a.warmup:
        log(f"  warm-up: {a.warmup} steps in {time.perf_counter() - t0:.1f} s"
            + (" (compilation included)" if mode == "compiled" else ""))
    windows = []
    for run in range(a.runs):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            loss = step(i)
            if i == 0:
                first = loss
            i += 1
        sync(device)
        windows.append(time.perf_counter() - t0)
        tok = a.batch * a.context * a.steps / windows[-1]
        log(f"  run {run + 1}: {a.steps} steps in {windows[-1]:.3f} s, {tok:,.0f} tokens/s, "
            f"{1e3 * windows[-1] / a.steps:.2f} ms/step, loss {loss.item():.4f}")
    result = {
        "windows": windows,
        "first_loss": first.item(),
        "last_loss": loss.item(),
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "attention": attention,
    }
    del model, forward, opt, params
    return result


# ---------------------------------------------------------------- self-test


def self_test():
    """On the CPU in f32: sdpa_loss against parity.gpt_loss (loss and gradients) on a
    tiny GPT, and the parameter count N of the MFU formula against the closed form
    V C + L (12 C^2 + 12 C) + 2 C (wte; per block q, k, v, o, fc and proj weights and
    12 C of norms and biases, no key bias; the final norm)."""
    ok = True
    torch.manual_seed(0)
    for layers, dim, heads, context, vocab, batch in [(2, 64, 4, 32, 100, 3), (3, 48, 6, 16, 50, 2)]:
        cfg = SimpleNamespace(layers=layers, dim=dim, heads=heads, context=context, vocab=vocab)
        init = parity.init_params(model_text(cfg), 1)
        g = torch.Generator().manual_seed(2)
        tokens = torch.randint(0, vocab, (batch, context), generator=g)
        targets = torch.randint(0, vocab, (batch, context), generator=g)
        losses, grads = [], []
        for fn in (parity.gpt_loss, sdpa_loss):
            p = {n: t.clone().requires_grad_(True) for n, t in init.items()}
            loss = fn(p, tokens, targets, layers, heads)
            loss.backward()
            losses.append(loss.item())
            grads.append({n: q.grad for n, q in p.items()})
        loss_rel = abs(losses[1] - losses[0]) / abs(losses[0])
        grad_rel = {n: ((grads[1][n] - g0).abs().max() / g0.abs().max().clamp_min(1e-30)).item()
                    for n, g0 in grads[0].items()}
        worst = max(grad_rel, key=grad_rel.get)
        good = loss_rel <= LOSS_RTOL and grad_rel[worst] <= GRAD_RTOL
        ok &= good
        print(f"self-test sdpa_loss vs parity.gpt_loss ({layers} layers, dim {dim}, {heads} heads, "
              f"context {context}, vocab {vocab}, batch {batch}, f32 cpu): loss {losses[0]:.8f} vs "
              f"{losses[1]:.8f}, rel diff {loss_rel:.2e} (<= {LOSS_RTOL:g}); gradients rel diff max "
              f"{grad_rel[worst]:.2e} ({worst}, <= {GRAD_RTOL:g}): {'ok' if good else 'FAIL'}")
    for layers, dim, heads, context, vocab in [(12, 768, 12, 1024, 50304), (2, 64, 4, 32, 100)]:
        cfg = SimpleNamespace(layers=layers, dim=dim, heads=heads, context=context, vocab=vocab)
        fpt, n = flops_per_token(param_shapes(model_text(cfg)), layers, heads, dim, context)
        want = vocab * dim + layers * (12 * dim * dim + 12 * dim) + 2 * dim
        good = n == want
        ok &= good
        print(f"self-test parameter count ({layers} layers, dim {dim}, vocab {vocab}): N = {n:,} "
              f"without wpe (closed form {want:,}), {fpt:,} FLOPs/token: {'ok' if good else 'FAIL'}")
    return ok


# ---------------------------------------------------------------- main


def main(argv=None):
    a = parse_args(argv)
    if a.self_test:
        return 0 if self_test() else 1
    if a.device == "cuda" and not torch.cuda.is_available():
        print(f"gpt_gpu_bench: no CUDA device (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda}); --device cpu for a smoke run", file=sys.stderr)
        return 2
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    set_tf32(cuda and a.precision == "bf16")
    name = torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    peak, peak_source = peak_tflops(a, name)

    text = model_text(a)
    fpt, n_params = flops_per_token(param_shapes(text), a.layers, a.heads, a.dim, a.context)
    t0 = time.perf_counter()
    init = parity.init_params(text, a.seed)
    log(f"gpt ({a.layers} layers, dim {a.dim}, {a.heads} heads, context {a.context}, vocab "
        f"{a.vocab}): {n_params:,} parameters without wpe, {fpt / 1e6:,.1f} MFLOPs/token; "
        f"weights drawn in {time.perf_counter() - t0:.1f} s")
    g = torch.Generator().manual_seed(a.seed)
    pool = [tuple(torch.randint(0, a.vocab, (a.batch, a.context), generator=g).to(device)
                  for _ in range(2)) for _ in range(POOL)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tf32 = torch.backends.cuda.matmul.allow_tf32
    log(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {name}; {a.precision}, TF32 "
        f"{'allowed' if tf32 else 'off'}; batch {a.batch} x {a.context} tokens, {a.warmup} warm-up "
        f"+ {a.runs} x {a.steps} timed steps; peak {peak if peak else 'unknown'} TFLOP/s "
        f"({peak_source})")

    failed = 0
    for mode in a.modes:
        log(f"{mode}:")
        line = {"impl": "pytorch", "mode": mode, "device": name, "precision": a.precision,
                "batch": a.batch, "context": a.context}
        try:
            r = run_mode(a, mode, init, pool, device)
            windows = r.pop("windows")
            med = statistics.median(windows)
            tok = a.batch * a.context * a.steps / med
            line.update({
                "tokens_per_sec": round(tok, 1),
                "step_ms": round(1e3 * med / a.steps, 3),
                "first_loss": r["first_loss"],
                "peak_memory_bytes": r["peak_memory_bytes"],
                "model_flops_per_sec": round(fpt * tok),
                "mfu": round(fpt * tok / (peak * 1e12), 4) if peak else None,
            })
        except Exception as e:  # report it, go on with the next mode
            failed += 1
            line["error"] = f"{type(e).__name__}: {e}".strip()[:2000]
            log(f"  FAILED: {line['error']}")
            r, windows = None, []
        line.update({
            "torch": torch.__version__,
            "layers": a.layers, "dim": a.dim, "heads": a.heads, "vocab": a.vocab,
            "warmup": a.warmup, "steps": a.steps, "runs": a.runs,
            "runs_tokens_per_sec": [round(a.batch * a.context * a.steps / t, 1) for t in windows],
            "last_loss": r["last_loss"] if r else None,
            "attention": r["attention"] if r else None,
            "tf32": tf32,
            "params_without_wpe": n_params,
            "flops_per_token": fpt,
            "peak_tflops": peak,
            "peak_source": peak_source,
            "cuda": torch.version.cuda,
        })
        out = json.dumps(line)
        print(out, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(out + "\n")
        # Free this mode's memory before the next one measures its peak.
        gc.collect()
        if mode == "compiled":
            torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()
    return 1 if failed == len(a.modes) else 0


if __name__ == "__main__":
    sys.exit(main())
