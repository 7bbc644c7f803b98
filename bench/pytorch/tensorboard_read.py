"""distc's --tensorboard event files read back by TensorBoard's own reader (issue 66,
item 3): a run of 2 all-reduce workers and a pipelined run each write event files
beside their JSONL metrics; every scalar TensorBoard reads must equal the metrics
line's number of that step (as f32), and the per-worker and per-stage tags must be
there. Exit 1 on any difference.

Usage: python bench/pytorch/tensorboard_read.py --distc target/debug/distc
(install: scripts/install-pytorch.sh, then scripts/install-tensorboard.sh)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from tensorboard.backend.event_processing import event_accumulator

MODEL = """model deep {
  input x: f32[B, 16]
  input label: i32[B]
  param w1: f32[16, 32] = glorot
  param w2: f32[32, 3] = glorot
  h = relu(x @ w1)
  pipeline_stage
  minimize softmax_cross_entropy(h @ w2, label)
}
train {
  data = gaussian_classes(features = 16, classes = 3)
  batch = 8
  optimizer = adamw(lr = 0.01)
  lr_schedule = cosine(warmup = 2)
  steps = 6
  seed = 1
}
"""


def flatten(prefix, value, out):
    if isinstance(value, bool):
        out[prefix] = float(value)
    elif isinstance(value, (int, float)):
        out[prefix] = float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{prefix}/{k}" if prefix else k, v, out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            flatten(f"{prefix}/{i}" if prefix else str(i), v, out)


def check(distc, work, name, flags, want_tags):
    model = os.path.join(work, "deep.dsl")
    with open(model, "w") as f:
        f.write(MODEL)
    logdir = os.path.join(work, name)
    metrics = os.path.join(work, f"{name}.jsonl")
    cmd = [distc, "train", model, "-q", "--no-eval", "--metrics", metrics, "--tensorboard", logdir] + flags
    subprocess.run(cmd, check=True)
    files = [f for f in os.listdir(logdir) if "tfevents" in f]
    assert len(files) == 1, f"{name}: event files {files}"
    acc = event_accumulator.EventAccumulator(os.path.join(logdir, files[0]), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    lines = [json.loads(l) for l in open(metrics)]
    bad = 0
    for line in lines:
        want = {}
        flatten("", line, want)
        want.pop("step")
        for tag, value in want.items():
            if tag not in tags:
                print(f"{name}: tag {tag} is not in the event file"); bad += 1; continue
            got = {e.step: e.value for e in acc.Scalars(tag)}
            if line["step"] not in got or got[line["step"]] != np.float32(value):
                print(f"{name}: {tag} at step {line['step']}: {got.get(line['step'])} against {value}"); bad += 1
    for t in want_tags:
        if t not in tags:
            print(f"{name}: no tag {t}"); bad += 1
    n = sum(len(acc.Scalars(t)) for t in tags)
    print(f"tensorboard {name}: {len(tags)} tags, {n} scalars over {len(lines)} steps read by TensorBoard "
          f"{'equal the metrics lines' if bad == 0 else f'with {bad} differences'}")
    return bad


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--distc", required=True)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        bad = check(a.distc, work, "allreduce", ["--strategy", "allreduce", "--workers", "2"],
                    ["loss", "lr", "samples_per_sec", "memory/params", "bytes_sent_per_worker/1"])
        bad += check(a.distc, work, "pipeline", ["--pipeline", "2", "--micro-batches", "2"],
                     ["loss", "pipeline/stages/1/busy_sec", "pipeline/stages/0/activations"])
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
