#!/usr/bin/env python3
"""Writes a GPT-2-style decoder as a distc model: examples/gpt.dsl is this script's
output with its defaults, and any other size is one command away.

    python3 scripts/gpt-dsl.py > examples/gpt.dsl
    python3 scripts/gpt-dsl.py --layers 12 --dim 768 --heads 12 --context 1024 \\
        --vocab 50257 > gpt2-124m.dsl

The model: token and position embeddings; pre-norm blocks of causal multi-head
attention (q, k and v projections of their own, so a model axis splits each by
heads; no key bias, whose gradient the softmax makes zero) and a GELU (tanh) MLP of 4x the width; a final layer norm; the output tied to
the token embedding. Initialised as GPT-2: N(0, 0.02) weights, the residual
projections N(0, 0.02 / sqrt(2 * layers)), zero biases, unit norm gains.
bench/pytorch/parity.py builds the same network from the same arguments.
"""
import argparse
import math


def args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--vocab", type=int, default=10000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--data", default="ptb-tokens",
                   help="the token files' folder under --data (scripts/ptb-tokens.py)")
    p.add_argument("--stages", action="store_true",
                   help="mark a pipeline stage between every two blocks")
    return p.parse_args(argv)


def dsl(a):
    if a.dim % a.heads:
        raise SystemExit(f"--dim {a.dim} is not a multiple of --heads {a.heads}")
    c, t, h, v = a.dim, a.context, a.heads, a.vocab
    d = c // h
    proj_std = 0.02 / math.sqrt(2 * a.layers)
    w = lambda std: f"normal(0, {std:.6g})"
    out = [
        f"# A GPT-2-style decoder: {a.layers} blocks, width {c}, {h} heads, context {t},",
        f"# vocabulary {v}; written by scripts/gpt-dsl.py (run it for other sizes).",
        "#   python3 scripts/ptb-tokens.py ../shared/data/ptb DATA/ptb-tokens",
        "#   distc train examples/gpt.dsl --data DATA",
        "model gpt {",
        f"  input tokens:  i32[B, {t}]",
        f"  input targets: i32[B, {t}]",
        "",
        f"  param wte: f32[{v}, {c}] = {w(0.02)}",
        f"  param wpe: f32[{t}, {c}] = {w(0.02)}",
    ]
    for i in range(a.layers):
        p = f"h{i}_"
        out += [
            f"  param {p}ln1_g: f32[{c}] = ones",
            f"  param {p}ln1_b: f32[{c}] = zeros",
        ]
        for n in "qkv":
            out.append(f"  param {p}w{n}: f32[{c}, {c}] = {w(0.02)}")
            # No key bias: it adds q . b to every score of a query's row, which the
            # softmax cancels, so its gradient is zero up to rounding, and Adam would
            # turn that rounding into steps of size lr.
            if n != "k":
                out.append(f"  param {p}b{n}: f32[{c}] = zeros")
        out += [
            f"  param {p}wo: f32[{c}, {c}] = {w(proj_std)}",
            f"  param {p}bo: f32[{c}] = zeros",
            f"  param {p}ln2_g: f32[{c}] = ones",
            f"  param {p}ln2_b: f32[{c}] = zeros",
            f"  param {p}wfc: f32[{c}, {4 * c}] = {w(0.02)}",
            f"  param {p}bfc: f32[{4 * c}] = zeros",
            f"  param {p}wproj: f32[{4 * c}, {c}] = {w(proj_std)}",
            f"  param {p}bproj: f32[{c}] = zeros",
        ]
    out += [
        f"  param lnf_g: f32[{c}] = ones",
        f"  param lnf_b: f32[{c}] = zeros",
        "",
        "  x0 = embedding(wte, tokens) + wpe",
    ]
    heads = lambda e: f"transpose(reshape({e}, [B, {t}, {h}, {d}]), [0, 2, 1, 3])"
    for i in range(a.layers):
        p, x, nx = f"h{i}_", f"x{i}", f"x{i + 1}"
        if a.stages and i > 0 and i % 2 == 0:
            out.append("  pipeline_stage")
        out += [
            f"  a{i} = layer_norm({x}, {p}ln1_g, {p}ln1_b)",
            f"  q{i} = {heads(f'a{i} @ {p}wq + {p}bq')}",
            f"  k{i} = {heads(f'a{i} @ {p}wk')}",
            f"  v{i} = {heads(f'a{i} @ {p}wv + {p}bv')}",
            f"  y{i} = reshape(transpose(attention(q{i}, k{i}, v{i}, causal = true), [0, 2, 1, 3]), [B, {t}, {c}])",
            f"  r{i} = {x} + y{i} @ {p}wo + {p}bo",
            f"  m{i} = layer_norm(r{i}, {p}ln2_g, {p}ln2_b)",
            f"  {nx} = r{i} + gelu(m{i} @ {p}wfc + {p}bfc, approximate = \"tanh\") @ {p}wproj + {p}bproj",
        ]
    out += [
        f"  f = layer_norm(x{a.layers}, lnf_g, lnf_b)",
        "  logits = matmul(f, wte, transpose_b = true)",
        "  minimize softmax_cross_entropy(logits, targets)",
        "}",
        "",
        "train {",
        f"  data      = tokens(path = \"{a.data}/train.bin\", eval_path = \"{a.data}/valid.bin\",",
        f"                     dtype = \"u16\", context = {t})",
        f"  batch     = {a.batch}",
        f"  optimizer = adamw(lr = {a.lr:g}, beta1 = 0.9, beta2 = 0.95, weight_decay = 0.1)",
        "  decay_min_rank = 2",
        "  clip_norm = 1.0",
        f"  lr_schedule = cosine(warmup = {max(1, a.steps // 20)}, final = 0.1)",
        f"  steps     = {a.steps}",
        "  seed      = 1",
        "  eval_every   = 0",
        "  eval_samples = 4096",
        "  metrics   = [accuracy, perplexity]",
        "}",
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(dsl(args()), end="")
