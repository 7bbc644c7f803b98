#!/usr/bin/env python3
"""Penn Treebank as token files for the `tokens(...)` data source.

    python3 scripts/ptb-tokens.py PTB_DIR OUT_DIR

PTB_DIR holds ptb.train.txt, ptb.valid.txt and ptb.test.txt (../shared/data/ptb);
OUT_DIR gets train.bin, valid.bin and test.bin (little-endian u16 ids, no header: the
nanoGPT and llm.c layout) and vocab.txt (one word a line, line k is id k).

The ids are those of distc's built-in `ptb()` source: each line split on whitespace
with `<eos>` appended, the vocabulary from the train split sorted by descending count
then by the word's bytes (id 0 is the most frequent word); a word of another split
missing from it maps to `<unk>`. So `tokens(path = "ptb-tokens/train.bin", ...)`
reads the same stream as `ptb()`.
"""
import collections
import os
import struct
import sys


def words(path):
    with open(path, "rb") as f:
        for line in f:
            yield from line.split()
            yield b"<eos>"


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    splits = {s: os.path.join(src, f"ptb.{s}.txt") for s in ("train", "valid", "test")}
    for path in splits.values():
        if not os.path.isfile(path):
            sys.exit(f"ptb-tokens: {path}: not found (PTB_DIR must hold ptb.{{train,valid,test}}.txt)")
    counts = collections.Counter(words(splits["train"]))
    vocab = sorted(counts, key=lambda w: (-counts[w], w))
    if len(vocab) > 65535:
        sys.exit(f"ptb-tokens: {len(vocab)} words do not fit u16 ids")
    ids = {w: i for i, w in enumerate(vocab)}
    unk = ids.get(b"<unk>")
    os.makedirs(out, exist_ok=True)
    for split, path in splits.items():
        stream = []
        for w in words(path):
            i = ids.get(w, unk)
            if i is None:
                sys.exit(f"ptb-tokens: {path}: `{w.decode()}` is not in the vocabulary and there is no <unk>")
            stream.append(i)
        tmp = os.path.join(out, f".{split}.bin.tmp")
        with open(tmp, "wb") as f:
            f.write(struct.pack(f"<{len(stream)}H", *stream))
        os.replace(tmp, os.path.join(out, f"{split}.bin"))
        print(f"{split}.bin: {len(stream)} tokens")
    with open(os.path.join(out, "vocab.txt"), "wb") as f:
        f.write(b"\n".join(vocab) + b"\n")
    print(f"vocab.txt: {len(vocab)} words")


if __name__ == "__main__":
    main()
