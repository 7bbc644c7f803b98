#!/usr/bin/env python3
"""Parity check: distc trains a GPT, or a ResNet with batch norm, exactly as PyTorch does.

Both sides start from the same weights (drawn here as the DSL's initialisers say,
handed to distc with `--init`), read the same batches in the same order (a
safetensors file read by distc's `tensors(..., shuffle = false)` source), and run
the same optimizer, in the same precision (`--dtype`). In f32 the check passes when
every step's loss agrees to a relative 1e-5 and every final variable to
max|w_distc - w_torch| / max|w_torch| <= 1e-4. Where the weights are past 1e-4 with
the losses in tolerance, the same training runs in float64, and the case passes only
if distc is no farther from it than PyTorch's own f32 is. The verdict says which of
the two held. In float64 (`--dtype f64`: the model's f32 types written as f64 for
distc, PyTorch in float64) the tolerances are 1e-9 and 1e-7, with no fallback.

`--model gpt` (the default): scripts/gpt-dsl.py's GPT-2-style decoder at the size
given here, AdamW (beta 0.9/0.95, eps 1e-8, weight decay 0.1 on the rank >= 2
variables only) after clipping the global gradient norm. `--untied` gives it a
head of its own (`lm_head`), so the token table's gradient is an embedding's alone:
row-sparse in distc, which AdamW applies to every row, as torch.optim does. Adam divides each gradient
by its magnitude, so an element whose gradient is near eps moves by up to a step of
lr on rounding alone, and two correct f32 runs (PyTorch against itself with the
batch summed in two halves) differ by 1e-4 of the largest weight after one step:
hence the float64 verdict. Batches are Penn Treebank windows when `--data DIR` (or
$DISTC_DATA) holds ptb-tokens/train.bin (scripts/ptb-tokens.py), uniform random ids
otherwise. The trained weights then go through `distc predict` on the first batch and
a partial one: every position's logits [N, T, V], against PyTorch's forward pass of
the same weights (float64) to the weight tolerance of the largest logit.

`--model resnet`: the model block of examples/resnet.dsl (convolutions, batch norm,
residual sums, global mean pooling), built here in functional form, SGD with
momentum (torch.optim.SGD's rule, distc's `sgd(lr, momentum)`: v = mu v + g,
w -= lr v). Each `batch_norm(x, gamma, beta)` trains on the batch's statistics and
keeps the frozen variables `<gamma>_running_mean` and `<gamma>_running_var`, which
PyTorch's F.batch_norm updates as distc does (momentum 0.1, the unbiased variance):
they start in the `--init` file (zeros and ones) and are compared at the end like
the weights. It trains in float64 unless `--dtype f32`: in f32, PyTorch's own run is
past the weight tolerance from float64 training within 3 to 6 steps and past the
loss tolerance within about 10 (the betas move furthest: batch norm's backward
cancels most of their gradient), so f32 cannot tell a bug from rounding here.
Batches are the first MNIST training images (pixels / 255, f32 [N, 1, 28, 28]) when
`--data DIR` holds mnist/train-images-idx3-ubyte.gz and
mnist/train-labels-idx1-ubyte.gz (the layout distc's `mnist()` reads), uniform random
images and labels otherwise.

With `--workers W` (W > 1) distc runs W data-parallel workers (allreduce) of
`--batch` samples each; PyTorch then trains on the global batch of W * batch
samples, which is what the W workers together see at each step. (For the ResNet
that holds because `batch_norm`'s default `sync = true` all-reduces the batch
moments: the W workers normalise with the global batch's statistics.)

`--torch-only` trains the PyTorch side alone (no distc binary needed), in f32 and in
float64, and prints how far apart the two are: the scale of f32 rounding for this
model. `--keep DIR` keeps each case's files (model.dsl, init.safetensors,
batches.safetensors, and distc's metrics and final weights) in DIR/<model>-w<W>.

Usage (the environment from scripts/install-pytorch.sh):
  .venv-bench/bin/python bench/pytorch/parity.py
  .venv-bench/bin/python bench/pytorch/parity.py --workers 1 2 --data /path/to/data
  .venv-bench/bin/python bench/pytorch/parity.py --model resnet --workers 1 2 --data DIR

Exit status: 0 when every case passes, 1 when one fails, 2 on a setup error.
"""
import argparse
import gzip
import importlib.util
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from collections import namedtuple
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
LN_EPS = 1e-5
# (loss, weights) tolerances by the precision both sides train in. float64: a 1-ulp
# change of the initial weights moves the ResNet's 50 SGD steps (MNIST or random
# images, 1 or 2 workers' batches) by 1e-15 (losses) and 2e-14 (weights), so 1e-9 and
# 1e-7 leave a wide margin for the two sides' different summation orders, and still
# see a running variance scaled by n/(n-1) with one worker's n instead of the global
# batch's, or left biased (3e-4 at batch 8x2).
TOLERANCES = {"f32": (1e-5, 1e-4), "f64": (1e-9, 1e-7)}
DTYPES = {"f32": torch.float32, "f64": torch.float64}

# The flags whose default depends on the model; a flag the chosen model does not read
# is refused rather than ignored. The ResNet trains in float64 by default: in f32,
# PyTorch's own training of it is 6e-3 (losses) and 3e-1 (a beta) from float64 training
# after 50 steps, past both f32 tolerances (see the module doc).
MODEL_FLAGS = {
    "gpt": {"layers": 2, "dim": 64, "heads": 4, "context": 32, "vocab": 10000,
            "lr": 1e-3, "clip": 1.0, "weight_decay": 0.1, "dtype": "f32", "untied": False},
    "resnet": {"lr": 0.05, "momentum": 0.9, "dtype": "f64"},
}


class SetupError(Exception):
    """Something other than a mismatch stops the check (exit status 2)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODEL_FLAGS), default="gpt",
                   help="gpt: scripts/gpt-dsl.py's decoder (default); "
                        "resnet: examples/resnet.dsl (batch norm)")
    p.add_argument("--distc", default=str(ROOT / "target/release/distc"),
                   help="the distc binary (default: target/release/distc)")
    p.add_argument("--data", default=os.environ.get("DISTC_DATA"),
                   help="gpt: folder holding ptb-tokens/train.bin; resnet: folder holding "
                        "mnist/ (the IDX .gz files) (default: $DISTC_DATA); random data "
                        "without it")
    p.add_argument("--layers", type=int, help="gpt (default 2)")
    p.add_argument("--dim", type=int, help="gpt (default 64)")
    p.add_argument("--heads", type=int, help="gpt (default 4)")
    p.add_argument("--context", type=int, help="gpt (default 32)")
    p.add_argument("--vocab", type=int, help="gpt (default 10000)")
    p.add_argument("--batch", type=int, default=8, help="samples per worker and step")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, help="default: gpt 1e-3, resnet 0.05")
    p.add_argument("--clip", type=float,
                   help="gpt: global gradient-norm clip (default 1.0; 0: none)")
    p.add_argument("--weight-decay", type=float,
                   help="gpt: AdamW decay of the rank >= 2 variables (default 0.1; 0 to "
                        "isolate it)")
    p.add_argument("--untied", action="store_true", default=None,
                   help="gpt: a head of its own (lm_head), so that the token table's "
                        "gradient is an embedding's alone: row-sparse, which AdamW "
                        "updates in every row as torch.optim does")
    p.add_argument("--momentum", type=float, help="resnet: SGD momentum (default 0.9)")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="the precision both sides train in (default: gpt f32, resnet f64); "
                        "tolerances: f32 loss 1e-5 and weights 1e-4, f64 1e-9 and 1e-7")
    p.add_argument("--workers", type=int, nargs="+", default=[1],
                   help="data-parallel worker counts, one case each")
    p.add_argument("--seed", type=int, default=1, help="seeds the weights and random data")
    p.add_argument("--torch-only", action="store_true",
                   help="train only the PyTorch side, f32 against float64 (no distc)")
    p.add_argument("--keep", metavar="DIR",
                   help="keep each case's files in DIR/<model>-w<workers>")
    a = p.parse_args(argv)
    for model, flags in MODEL_FLAGS.items():
        for flag in flags:
            if model == a.model or flag in MODEL_FLAGS[a.model]:
                continue
            if getattr(a, flag) is not None:
                p.error(f"--{flag.replace('_', '-')} is for --model {model}, "
                        f"not --model {a.model}")
    for flag, default in MODEL_FLAGS[a.model].items():
        if getattr(a, flag) is None:
            setattr(a, flag, default)
    return a


# ---------------------------------------------------------------- the DSL text


PARAM = re.compile(r"^\s*param\s+(\w+)\s*:\s*f32\[([\d, ]+)\]\s*=\s*(.+?)\s*$")
NORMAL = re.compile(r"normal\(0, ([0-9.eE+-]+)\)")


def fans(shape):
    """(fan_in, fan_out) as distc's initialisers count them (runtime/src/core/init.rs):
    [in, out] for a matrix, C*KH*KW and O*KH*KW for an [O, C, KH, KW] filter."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    r = math.prod(shape[2:])
    return (shape[0], shape[1]) if len(shape) == 2 else (shape[1] * r, shape[0] * r)


def init_params(model_text, seed):
    """Draws the variables from the `param` lines of the model text itself, so the
    names, shapes and initialisers cannot drift from what distc compiles (the std
    is the DSL's printed one, 6 significant digits). `he` and `glorot` follow distc's
    definitions (N(0, sqrt(2/fan_in)), U(+-sqrt(6/(fan_in+fan_out)))) with this
    generator: the same distributions, not distc's values."""
    g = torch.Generator().manual_seed(seed)
    params = {}
    for line in model_text.splitlines():
        m = PARAM.match(line.split("#")[0])
        if not m:
            continue
        name, init = m.group(1), m.group(3)
        shape = [int(d) for d in m.group(2).split(",")]
        fan_in, fan_out = fans(shape)
        if init == "zeros":
            t = torch.zeros(shape)
        elif init == "ones":
            t = torch.ones(shape)
        elif (n := NORMAL.fullmatch(init)):
            t = torch.empty(shape).normal_(0.0, float(n.group(1)), generator=g)
        elif init == "he":
            t = torch.empty(shape).normal_(0.0, math.sqrt(2.0 / fan_in), generator=g)
        elif init == "glorot":
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            t = torch.empty(shape).uniform_(-bound, bound, generator=g)
        else:
            raise SetupError(f"param {name}: initialiser `{init}` not handled here")
        params[name] = t
    if not params:
        raise SetupError("no `param` lines in the model text")
    return params


def calls(model_text, fn):
    """The arguments of every call of `fn` in the model text, comments dropped: one
    list per call of (keyword or None, argument text)."""
    code = "\n".join(line.split("#")[0] for line in model_text.splitlines())
    found = []
    for m in re.finditer(rf"\b{fn}\s*\(", code):
        args, start, depth, i = [], m.end(), 1, m.end()
        while depth:
            if i == len(code):
                raise SetupError(f"`{fn}(` at offset {m.start()} is never closed")
            c = code[i]
            if c in "([":
                depth += 1
            elif c in ")]":
                depth -= 1
            elif c == "," and depth == 1:
                args.append(code[start:i])
                start = i + 1
            i += 1
        args.append(code[start:i - 1])
        kw = [re.fullmatch(r"\s*(\w+)\s*=\s*(.+?)\s*", s, re.S) for s in args]
        found.append([(k.group(1), k.group(2)) if k else (None, s.strip())
                      for k, s in zip(kw, args)])
    return found


BatchNorm = namedtuple("BatchNorm", "beta momentum eps sync")
BATCH_NORM_ARGS = ("x", "gamma", "beta", "momentum", "eps", "sync")


def batch_norms(model_text):
    """Every `batch_norm(x, gamma, beta, momentum = 0.1, eps = 1e-5, sync = true)` of
    the model text, by its gamma (which names its running statistics)."""
    norms = {}
    for args in calls(model_text, "batch_norm"):
        bound = {}
        for i, (key, value) in enumerate(args):
            key = key or (BATCH_NORM_ARGS[i] if i < len(BATCH_NORM_ARGS) else None)
            if key not in BATCH_NORM_ARGS or key in bound:
                raise SetupError(f"batch_norm: argument `{value}` not understood here")
            bound[key] = value
        gamma, beta = bound.get("gamma", ""), bound.get("beta", "")
        if not (gamma.isidentifier() and beta.isidentifier()):
            raise SetupError(f"batch_norm({', '.join(v for _, v in args)}): gamma and beta "
                             "must be variables")
        if bound.get("sync", "true") not in ("true", "false"):
            raise SetupError(f"batch_norm of {gamma}: sync = {bound['sync']}")
        if gamma in norms:
            raise SetupError(f"two batch_norms with gamma {gamma}")
        norms[gamma] = BatchNorm(beta, float(bound.get("momentum", 0.1)),
                                 float(bound.get("eps", 1e-5)),
                                 bound.get("sync", "true") == "true")
    return norms


def running_stats(norms, params):
    """The frozen variables each batch norm adds, as they start."""
    stats = {}
    for gamma in norms:
        if gamma not in params:
            raise SetupError(f"batch_norm's gamma {gamma} is no `param`")
        channels = params[gamma].shape[0]
        stats[f"{gamma}_running_mean"] = torch.zeros(channels)
        stats[f"{gamma}_running_var"] = torch.ones(channels)
    return stats


# ---------------------------------------------------------------- the GPT


def load_gpt_dsl():
    """scripts/gpt-dsl.py as a module (its name has a dash, so no plain import)."""
    path = ROOT / "scripts" / "gpt-dsl.py"
    if not path.is_file():
        raise SetupError(f"{path}: not found")
    spec = importlib.util.spec_from_file_location("gpt_dsl", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model_block(a):
    """The DSL text of the GPT at this size, without gpt-dsl.py's train block; under
    --untied the head is a variable of its own, `lm_head` [C, V], so that the token
    table's gradient is row-sparse (an embedding's alone)."""
    gd = load_gpt_dsl()
    text = gd.dsl(gd.args([
        "--layers", str(a.layers), "--dim", str(a.dim), "--heads", str(a.heads),
        "--context", str(a.context), "--vocab", str(a.vocab),
    ]))
    text = text[: text.index("train {")]
    if a.untied:
        tied = "logits = matmul(f, wte, transpose_b = true)"
        if tied not in text:
            raise SetupError(f"scripts/gpt-dsl.py no longer writes `{tied}`")
        text = text.replace(tied, "logits = f @ lm_head")
        head = f"  param lm_head: f32[{a.dim}, {a.vocab}] = normal(0, 0.02)\n"
        at = text.index("  param wte:")
        text = text[:at] + head + text[at:]
    return text


def gpt_logits(p, tokens, layers, heads):
    """The forward pass of gpt-dsl.py's model, op for op: [in, out] weights applied
    as x @ W + b, heads split as reshape [B, T, H, D] then transpose, attention
    written out (masked softmax) rather than SDPA so that no fused kernel rounds
    differently from the definition."""
    B, T = tokens.shape
    V, C = p["wte"].shape
    D = C // heads
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def split(y):
        return y.reshape(B, T, heads, D).transpose(1, 2)

    x = F.embedding(tokens, p["wte"]) + p["wpe"]
    for i in range(layers):
        w = lambda n: p[f"h{i}_{n}"]
        a = F.layer_norm(x, (C,), w("ln1_g"), w("ln1_b"), LN_EPS)
        q, k, v = split(a @ w("wq") + w("bq")), split(a @ w("wk")), split(a @ w("wv") + w("bv"))
        s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        att = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        r = x + y @ w("wo") + w("bo")
        m = F.layer_norm(r, (C,), w("ln2_g"), w("ln2_b"), LN_EPS)
        x = r + F.gelu(m @ w("wfc") + w("bfc"), approximate="tanh") @ w("wproj") + w("bproj")
    f = F.layer_norm(x, (C,), p["lnf_g"], p["lnf_b"], LN_EPS)
    return f @ p["lm_head"] if "lm_head" in p else f @ p["wte"].t()


def gpt_loss(p, tokens, targets, layers, heads):
    """The mean cross-entropy of every position's logits [B, T, V]."""
    logits = gpt_logits(p, tokens, layers, heads)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batches(a, n, data_dir, rng):
    """n samples of `tokens` and `targets` (int32 [n, T]) and where they came from.
    PTB: sample i is the window at i*T of the train stream, its targets shifted by
    one (the first n*T+1 tokens, so no window repeats)."""
    T = a.context
    ptb = Path(data_dir) / "ptb-tokens" / "train.bin" if data_dir else None
    if ptb is None or not ptb.is_file():
        tok = rng.integers(0, a.vocab, size=(n, T), dtype=np.int32)
        tgt = rng.integers(0, a.vocab, size=(n, T), dtype=np.int32)
        return tok, tgt, "random ids"
    stream = np.fromfile(ptb, dtype="<u2")
    if stream.size < n * T + 1:
        raise SetupError(f"{ptb}: {stream.size} tokens, {n * T + 1} needed "
                         f"({n} samples of {T}); use fewer --steps or a smaller --batch")
    stream = stream[: n * T + 1].astype(np.int32)
    if stream.max() >= a.vocab:
        raise SetupError(f"{ptb}: token id {stream.max()} does not fit --vocab {a.vocab}")
    return stream[:-1].reshape(n, T), stream[1:].reshape(n, T), "ptb"


class Gpt:
    """The GPT case: AdamW with decay only on rank >= 2 variables (distc's
    decay_min_rank = 2), after clip_grad_norm_."""

    name = "gpt"

    def __init__(self, a):
        if a.dim % a.heads:
            raise SetupError(f"--dim {a.dim} is not a multiple of --heads {a.heads}")
        self.a = a
        self.text = model_block(a)

    def size(self, workers, source):
        a = self.a
        return (f"{a.layers} layers, dim {a.dim}, {a.heads} heads, context {a.context}, "
                f"vocab {a.vocab}, batch {a.batch}x{workers} workers, {source}")

    def init(self):
        """The variables and the frozen running statistics (none here)."""
        return init_params(self.text, self.a.seed), {}

    def batches(self, n, rng):
        tokens, targets, source = make_batches(self.a, n, self.a.data, rng)
        return {"tokens": tokens, "targets": targets}, source

    def check_workers(self, workers):
        pass

    def loss(self, p, stats, batch):
        return gpt_loss(p, batch["tokens"], batch["targets"], self.a.layers, self.a.heads)

    def prediction(self, p, batch):
        """What `distc predict` writes: every position's logits, [B, T, V]."""
        return gpt_logits(p, batch["tokens"], self.a.layers, self.a.heads)

    def optimizer(self, params):
        a = self.a
        groups = [
            {"params": [q for q in params.values() if q.dim() >= 2], "weight_decay": a.weight_decay},
            {"params": [q for q in params.values() if q.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8)

    def before_step(self, params):
        if self.a.clip > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), self.a.clip)

    def optimizer_lines(self):
        """distc refuses `clip_norm = 0` and a `decay_min_rank` with no decay to exempt
        from, so --clip 0 and --weight-decay 0 (the switches for isolating a
        mismatch) leave those lines out."""
        a = self.a
        lines = [f"  optimizer = adamw(lr = {a.lr!r}, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, "
                 f"weight_decay = {a.weight_decay!r})"]
        if a.weight_decay > 0:
            lines.append("  decay_min_rank = 2")
        if a.clip > 0:
            lines.append(f"  clip_norm = {a.clip!r}")
        return lines


# ---------------------------------------------------------------- the ResNet


RESNET_DSL = ROOT / "examples" / "resnet.dsl"
MNIST_IMAGES = "train-images-idx3-ubyte.gz"
MNIST_LABELS = "train-labels-idx1-ubyte.gz"


def resnet_model_block():
    """examples/resnet.dsl without its train block."""
    if not RESNET_DSL.is_file():
        raise SetupError(f"{RESNET_DSL}: not found")
    text = RESNET_DSL.read_text()
    m = re.search(r"^train\s*\{", text, re.M)
    if not m:
        raise SetupError(f"{RESNET_DSL}: no train block")
    return text[: m.start()]


def resnet_loss(p, bn, image, label):
    """examples/resnet.dsl's forward pass, statement for statement: conv2d with OIHW
    filters and no bias, `bn(x, gamma, beta)` the batch norm, `mean(r2, axes = [2, 3])
    @ w + b` with w [in, out], the mean softmax cross-entropy."""
    def conv(x, k, stride=1, padding=0):
        return F.conv2d(x, p[k], stride=stride, padding=padding)

    h0 = F.relu(bn(conv(image, "stem", padding=1), "g0", "b0"))
    h1 = F.relu(bn(conv(h0, "k1a", padding=1), "g1a", "b1a"))
    r1 = F.relu(bn(conv(h1, "k1b", padding=1), "g1b", "b1b") + h0)
    h2 = F.relu(bn(conv(r1, "k2a", stride=2, padding=1), "g2a", "b2a"))
    s2 = bn(conv(r1, "k2s", stride=2), "g2s", "b2s")
    r2 = F.relu(bn(conv(h2, "k2b", padding=1), "g2b", "b2b") + s2)
    logits = r2.mean(dim=(2, 3)) @ p["w"] + p["b"]
    return F.cross_entropy(logits, label)


def read_idx(path, magic, count):
    """The first `count` items of a gzipped IDX file as a uint8 array [count, ...];
    reads only those bytes. The low byte of the magic number counts the dimensions."""
    with gzip.open(path, "rb") as f:
        head = f.read(4)
        if len(head) < 4 or struct.unpack(">I", head)[0] != magic:
            raise SetupError(f"{path}: not an IDX file of magic {magic}")
        dims = struct.unpack(f">{magic & 0xff}I", f.read(4 * (magic & 0xff)))
        if dims[0] < count:
            raise SetupError(f"{path}: {dims[0]} samples, {count} needed; use fewer "
                             "--steps or a smaller --batch")
        per = math.prod(dims[1:])
        data = f.read(count * per)
    if len(data) != count * per:
        raise SetupError(f"{path}: truncated")
    return np.frombuffer(data, dtype=np.uint8).reshape((count,) + tuple(dims[1:]))


def mnist_batches(n, data_dir, rng):
    """n samples of `image` (f32 [n, 1, 28, 28], pixels / 255 as distc's mnist()
    scales them) and `label` (int32 [n]), and where they came from: the first n
    MNIST training samples, in file order, or uniform random ones."""
    folder = Path(data_dir) / "mnist" if data_dir else None
    if folder is None or not (folder / MNIST_IMAGES).is_file():
        images = rng.random((n, 1, 28, 28), dtype=np.float32)
        labels = rng.integers(0, 10, size=n, dtype=np.int32)
        return {"image": images, "label": labels}, "random images"
    pixels = read_idx(folder / MNIST_IMAGES, 2051, n)
    if pixels.shape[1:] != (28, 28):
        raise SetupError(f"{folder / MNIST_IMAGES}: images of {pixels.shape[1:]}, not 28x28")
    labels = read_idx(folder / MNIST_LABELS, 2049, n)
    images = (pixels.astype(np.float32) / np.float32(255.0)).reshape(n, 1, 28, 28)
    return {"image": images, "label": labels.astype(np.int32)}, "mnist"


class Resnet:
    """The ResNet case: examples/resnet.dsl's model, SGD with momentum. The batch
    norms' gammas, betas and hyper-parameters come from the DSL's batch_norm calls;
    which layer uses which is resnet_loss's, and a batch norm of the DSL that it
    does not use, or a variable that gets no gradient, is an error."""

    name = "resnet"

    def __init__(self, a):
        self.a = a
        self.text = resnet_model_block()
        self.norms = batch_norms(self.text)
        if not self.norms:
            raise SetupError(f"{RESNET_DSL}: no batch_norm")
        self.used = set()

    def size(self, workers, source):
        return f"examples/resnet.dsl, batch {self.a.batch}x{workers} workers, {source}"

    def init(self):
        params = init_params(self.text, self.a.seed)
        return params, running_stats(self.norms, params)

    def batches(self, n, rng):
        return mnist_batches(n, self.a.data, rng)

    def check_workers(self, workers):
        unsynced = [g for g, bn in self.norms.items() if not bn.sync]
        if workers > 1 and unsynced:
            raise SetupError(f"batch_norm of {', '.join(unsynced)} has sync = false: each of "
                             f"{workers} workers normalises over its own samples, which "
                             "PyTorch on the global batch does not")

    def loss(self, p, stats, batch):
        def bn(x, gamma, beta):
            spec = self.norms.get(gamma)
            if spec is None or spec.beta != beta:
                raise SetupError(f"the torch model's batch norm ({gamma}, {beta}) is not one "
                                 f"of {RESNET_DSL.name}'s")
            self.used.add(gamma)
            return F.batch_norm(x, stats[f"{gamma}_running_mean"],
                                stats[f"{gamma}_running_var"], p[gamma], p[beta],
                                training=True, momentum=spec.momentum, eps=spec.eps)

        loss = resnet_loss(p, bn, batch["image"], batch["label"])
        if missing := sorted(set(self.norms) - self.used):
            raise SetupError(f"{RESNET_DSL.name}'s batch norm of {', '.join(missing)} is "
                             "not in the torch model (resnet_loss)")
        return loss

    def optimizer(self, params):
        return torch.optim.SGD(list(params.values()), lr=self.a.lr, momentum=self.a.momentum)

    def before_step(self, params):
        pass

    def optimizer_lines(self):
        return [f"  optimizer = sgd(lr = {self.a.lr!r}, momentum = {self.a.momentum!r})"]


MODELS = {"gpt": Gpt, "resnet": Resnet}


# ---------------------------------------------------------------- PyTorch


def train_torch(model, init, stats, batches, steps, global_batch, dtype=torch.float32):
    """The model's optimizer on its loss, one global batch a step; returns each step's
    pre-update loss and the final variables and running statistics, by name, in
    `dtype`."""
    params = {n: torch.nn.Parameter(t.to(dtype, copy=True)) for n, t in init.items()}
    stats = {n: t.to(dtype, copy=True) for n, t in stats.items()}
    opt = model.optimizer(params)
    data = {k: torch.from_numpy(v).long() if v.dtype.kind in "iu" else
            torch.from_numpy(v).to(dtype) for k, v in batches.items()}
    losses = []
    for t in range(steps):
        rows = slice(t * global_batch, (t + 1) * global_batch)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(params, stats, {k: v[rows] for k, v in data.items()})
        loss.backward()
        if t == 0 and (idle := [n for n, q in params.items() if q.grad is None]):
            raise SetupError(f"the torch {model.name} does not use {', '.join(idle)}")
        model.before_step(params)
        opt.step()
        losses.append(loss.item())
    final = {n: q.detach() for n, q in params.items()}
    final.update(stats)
    return losses, final


# ---------------------------------------------------------------- distc


def train_block(a, model):
    """distc's train block for these flags: the batches in file order, the optimizer
    as PyTorch runs it."""
    lines = [
        "train {",
        '  data      = tensors(path = "batches.safetensors", shuffle = false)',
        f"  batch     = {a.batch}",
        *model.optimizer_lines(),
        f"  steps     = {a.steps}",
        "  seed      = 1",
        "}",
    ]
    return "\n".join(lines) + "\n"


def write_inputs(a, model, workers, tmp):
    """The case's inputs in tmp (model.dsl, init.safetensors, batches.safetensors);
    returns the initial variables, the running statistics, the batches and their
    source."""
    from safetensors.torch import save_file

    global_batch = workers * a.batch
    dtype = DTYPES[a.dtype]
    init, stats = model.init()
    save_file({n: t.to(dtype) for n, t in {**init, **stats}.items()},
              str(tmp / "init.safetensors"))
    # f32 batches in either precision: their values are f32 numbers, read exactly.
    batches, source = model.batches(a.steps * global_batch, np.random.default_rng(a.seed))
    save_file({k: torch.from_numpy(v) for k, v in batches.items()},
              str(tmp / "batches.safetensors"))
    text = model.text if a.dtype == "f32" else re.sub(r"\bf32\[", f"{a.dtype}[", model.text)
    (tmp / "model.dsl").write_text(text + train_block(a, model))
    return init, stats, batches, source


def distc_command(a, workers, tmp):
    cmd = [a.distc, "train", str(tmp / "model.dsl"), "--data", str(tmp),
           "--init", str(tmp / "init.safetensors"),
           "--metrics", str(tmp / "metrics.jsonl"),
           "--save", str(tmp / "final.safetensors"), "-q"]
    if workers > 1:
        cmd += ["--workers", str(workers), "--strategy", "allreduce"]
    return cmd


def train_distc(a, workers, tmp):
    """Runs distc on the files in tmp; returns per-step losses (the mean over the
    workers, as its metrics report), the final weights and the wall time."""
    from safetensors.torch import load_file

    cmd = distc_command(a, workers, tmp)
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if run.returncode != 0:
        raise SetupError(f"{' '.join(cmd)}: exit status {run.returncode}\n"
                         f"{(run.stderr or run.stdout).strip()[-2000:]}")
    lines = [json.loads(l) for l in (tmp / "metrics.jsonl").read_text().splitlines() if l.strip()]
    losses = {l["step"]: l["loss"] for l in lines if "loss" in l}
    if sorted(losses) != list(range(1, a.steps + 1)):
        raise SetupError(f"distc's metrics name steps {sorted(losses)[:5]}..., "
                         f"want 1..{a.steps}")
    return [losses[s] for s in range(1, a.steps + 1)], load_file(tmp / "final.safetensors"), elapsed


def predict_distc(a, tmp, batches):
    """`distc predict` with the trained weights on the first batch and a partial one
    (the model's batch is fixed, so the last is padded and cut); returns the inputs
    and the prediction."""
    from safetensors.torch import load_file, save_file

    n = a.batch + 3
    inputs = {k: v[:n] for k, v in batches.items()}
    save_file({k: torch.from_numpy(v) for k, v in inputs.items()},
              str(tmp / "predict-in.safetensors"))
    cmd = [a.distc, "predict", str(tmp / "model.dsl"), "--init", str(tmp / "final.safetensors"),
           "--input", str(tmp / "predict-in.safetensors"),
           "-o", str(tmp / "prediction.safetensors")]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SetupError(f"{' '.join(cmd)}: exit status {run.returncode}\n"
                         f"{(run.stderr or run.stdout).strip()[-2000:]}")
    return inputs, load_file(tmp / "prediction.safetensors")["prediction"]


def check_prediction(a, model, weights, inputs, got):
    """Issue 67, item 1: `distc predict` of a sequence model is every position's
    output in the model's own shape (it wrote the first B rows of the flattened
    [B*T, V] logits), equal to PyTorch's forward pass (float64, from distc's saved
    weights) to the weights' tolerance of the largest logit. Returns whether it held."""
    with torch.no_grad():
        p = {n: w.double() for n, w in weights.items()}
        data = {k: torch.from_numpy(v).long() for k, v in inputs.items()}
        want = model.prediction(p, data)
    if list(got.shape) != list(want.shape):
        print(f"predict {model.name}: distc wrote {list(got.shape)}, the model's "
              f"prediction is {list(want.shape)}: FAIL")
        return False
    rel = ((got.double() - want).abs().max() / want.abs().max()).item()
    ok = rel <= TOLERANCES[a.dtype][1]
    print(f"predict {model.name}: {list(got.shape)} for {got.shape[0]} samples, rel diff "
          f"max {rel:.2e} against PyTorch: {'PASS' if ok else 'FAIL'}")
    return ok


# ---------------------------------------------------------------- the check


def differences(losses, weights, ref_losses, ref_weights):
    """Per-step relative loss differences and per-variable max|dw| / max|w_ref|."""
    loss_rel = [abs(x - r) / abs(r) for x, r in zip(losses, ref_losses)]
    weight_rel = {n: ((weights[n] - w).abs().max() / w.abs().max()).item()
                  for n, w in ref_weights.items()}
    return loss_rel, weight_rel


def worst(d):
    """The key of the largest value (a step index or a variable name)."""
    keys = range(len(d)) if isinstance(d, list) else d
    return max(keys, key=d.__getitem__)


def case_dir(a, model, workers):
    """The case's folder: a temporary one, or DIR/<model>-w<W> under --keep."""
    if not a.keep:
        return tempfile.TemporaryDirectory(prefix="distc-parity-")
    path = Path(a.keep) / f"{model.name}-w{workers}"
    path.mkdir(parents=True, exist_ok=True)
    return nullcontext(str(path))


def run_case(a, model, workers):
    """One case: distc with `workers` workers against PyTorch; prints the table and
    the summary line, returns whether it passed."""
    model.check_workers(workers)
    global_batch = workers * a.batch
    with case_dir(a, model, workers) as d:
        tmp = Path(d)
        init, stats, batches, source = write_inputs(a, model, workers, tmp)
        d_losses, d_weights, d_time = train_distc(a, workers, tmp)
        predicted = predict_distc(a, tmp, batches) if hasattr(model, "prediction") else None

    start = time.perf_counter()
    t_losses, t_weights = train_torch(model, init, stats, batches, a.steps, global_batch,
                                      DTYPES[a.dtype])
    t_time = time.perf_counter() - start

    if set(d_weights) != set(t_weights):
        raise SetupError(f"distc saved {sorted(set(d_weights) ^ set(t_weights))} "
                         "that the torch side does not have, or the reverse")
    for name, tw in t_weights.items():
        if d_weights[name].shape != tw.shape:
            raise SetupError(f"{name}: distc saved shape {list(d_weights[name].shape)}, "
                             f"torch has {list(tw.shape)}")
        if d_weights[name].dtype != tw.dtype:
            raise SetupError(f"{name}: distc saved {d_weights[name].dtype}, want {tw.dtype} "
                             f"(--dtype {a.dtype})")
    loss_rel, weight_rel = differences(d_losses, d_weights, t_losses, t_weights)
    worst_step = worst(loss_rel)
    worst_vars = sorted(init, key=weight_rel.get, reverse=True)
    worst_stats = sorted(stats, key=weight_rel.get, reverse=True)

    size = model.size(workers, source) + ("" if a.dtype == "f32" else f", {a.dtype}")
    print(f"\n== {model.name} ({size}); distc {d_time:.1f} s, torch {t_time:.1f} s")
    print(f"{'step':>6} {'loss distc':>14} {'loss torch':>14} {'rel diff':>10}")
    shown = sorted({0, a.steps - 1, worst_step})
    for s in shown:
        tag = "  (worst)" if s == worst_step else ""
        print(f"{s + 1:>6} {d_losses[s]:>14.8f} {t_losses[s]:>14.8f} {loss_rel[s]:>10.2e}{tag}")
    print(f"{'variable':>16} {'max|dw|/max|w|':>15}")
    for name in worst_vars[:5]:
        print(f"{name:>16} {weight_rel[name]:>15.2e}")
    if worst_stats:
        print(f"{'running stat':>16} {'max|dr|/max|r|':>15}")
        for name in worst_stats[:3]:
            print(f"{name:>16} {weight_rel[name]:>15.2e}")
    loss_rtol, weight_rtol = TOLERANCES[a.dtype]
    loss_ok = loss_rel[worst_step] <= loss_rtol
    ok = loss_ok and max(weight_rel.values()) <= weight_rtol
    verdict = "PASS" if ok else "FAIL"
    if not ok and a.dtype == "f32":
        (_, d64), (t64_loss, t64) = rounding_floor(model, init, stats, batches, a.steps,
                                                   global_batch, d_losses, d_weights,
                                                   t_losses, t_weights)
        # Past 1e-4 on the weights with the losses in tolerance: a pass only when distc
        # is no farther from exact (float64) training than PyTorch's own f32 is.
        if loss_ok and d64 <= t64:
            ok = True
            verdict = (f"PASS (weights at f32's rounding floor: distc {d64:.2e} from "
                       f"float64, PyTorch f32 {t64:.2e})")
        elif t64_loss > loss_rtol or t64 > weight_rtol:
            print("  PyTorch's own f32 training is past the tolerances from float64 here: "
                  "f32 cannot tell a bug from rounding in this case (--dtype f64 can)")
    stats_part = ""
    if worst_stats:
        stats_part = (f", running stats rel diff max {weight_rel[worst_stats[0]]:.2e} "
                      f"({worst_stats[0]})")
    if predicted is not None:
        ok = check_prediction(a, model, d_weights, *predicted) and ok
        verdict = verdict if ok else "FAIL"
    print(f"parity {model.name} ({size}): {a.steps} steps, loss rel diff max "
          f"{loss_rel[worst_step]:.2e} (step {worst_step + 1}), weights rel diff max "
          f"{weight_rel[worst_vars[0]]:.2e} ({worst_vars[0]}){stats_part}: {verdict}")
    return ok


def rounding_floor(model, init, stats, batches, steps, global_batch, d_losses, d_weights,
                   t_losses, t_weights):
    """On a failure, the same training in float64 tells a bug from f32 rounding: two
    correct f32 runs drift apart (through Adam most of all, in an element whose
    gradient is near eps: there g / (|g| + eps) turns the gradient's rounding into a
    step of lr), so distc should be about as far from float64 as PyTorch's f32 is.
    Returns the worst loss and the worst weight difference from float64 (over the
    variables and running statistics) of distc and of PyTorch f32."""
    r_losses, r_weights = train_torch(model, init, stats, batches, steps, global_batch,
                                      torch.float64)
    # Rounded to f32 as the runs it is compared with.
    r_weights = {n: w.float() for n, w in r_weights.items()}
    print("float64 reference (PyTorch), for scale:")
    worst_diffs = []
    for who, losses, weights in (("distc", d_losses, d_weights),
                                 ("torch f32", t_losses, t_weights)):
        loss_rel, weight_rel = differences(losses, weights, r_losses, r_weights)
        s, v = worst(loss_rel), worst(weight_rel)
        print(f"  {who:>9} vs f64: loss rel diff max {loss_rel[s]:.2e} (step {s + 1}), "
              f"weights rel diff max {weight_rel[v]:.2e} ({v})")
        worst_diffs.append((loss_rel[s], weight_rel[v]))
    return worst_diffs[0], worst_diffs[1]


def torch_only_case(a, model, workers):
    """The PyTorch side alone, in f32 and float64: how far f32 rounding alone takes
    this training (the scale the check's tolerances are set against). Under --keep
    it leaves distc's inputs and prints the command that the check would run."""
    model.check_workers(workers)
    global_batch = workers * a.batch
    with case_dir(a, model, workers) as d:
        tmp = Path(d)
        init, stats, batches, source = write_inputs(a, model, workers, tmp)
        if a.keep:
            print(f"\ndistc inputs in {tmp}: {' '.join(distc_command(a, workers, tmp))}")
    start = time.perf_counter()
    t_losses, t_weights = train_torch(model, init, stats, batches, a.steps, global_batch)
    t_time = time.perf_counter() - start
    r_losses, r_weights = train_torch(model, init, stats, batches, a.steps, global_batch,
                                      torch.float64)
    loss_rel, weight_rel = differences(t_losses, {n: w.double() for n, w in t_weights.items()},
                                       r_losses, r_weights)
    s, v = worst(loss_rel), worst(weight_rel)
    size = model.size(workers, source)
    print(f"torch-only {model.name} ({size}): {a.steps} steps in {t_time:.1f} s, loss "
          f"{t_losses[0]:.6f} -> {t_losses[-1]:.6f}; f32 vs float64: loss rel diff max "
          f"{loss_rel[s]:.2e} (step {s + 1}), weights rel diff max {weight_rel[v]:.2e} ({v})")
    return True


def main(argv=None):
    a = parse_args(argv)
    # float32 (or --dtype f64) throughout, as distc on the CPU; TF32 only matters on a
    # GPU but is ruled out so that the check means the same wherever it runs.
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        print("parity: safetensors is not installed (bash scripts/install-pytorch.sh)", file=sys.stderr)
        return 2
    if not a.torch_only and not os.access(a.distc, os.X_OK):
        print(f"parity: {a.distc}: no distc binary (cargo build --release, or --distc PATH)",
              file=sys.stderr)
        return 2
    case = torch_only_case if a.torch_only else run_case
    try:
        model = MODELS[a.model](a)
        results = [case(a, model, w) for w in a.workers]
    except SetupError as e:
        print(f"parity: {e}", file=sys.stderr)
        return 2
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
