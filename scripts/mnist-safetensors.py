#!/usr/bin/env python3
"""MNIST as safetensors files for the `tensors(...)` data source.

    python3 scripts/mnist-safetensors.py MNIST_DIR OUT_DIR

MNIST_DIR holds the four IDX files (train-images-idx3-ubyte.gz and the others, as in
../shared/data/mnist); OUT_DIR gets train.safetensors and test.safetensors, each with
`image` (uint8, [N, 784], the pixels as stored) and `label` (uint8, [N]). Written
with the standard library alone, in the safetensors layout: an 8-byte little-endian
header length, a JSON header naming each tensor's dtype, shape and byte range, then
the bytes. `safetensors.numpy.load_file` reads them back.
"""
import gzip
import json
import os
import struct
import sys


def idx(path, magic):
    with gzip.open(path, "rb") as f:
        data = f.read()
    found, count = struct.unpack(">II", data[:8])
    if found != magic:
        sys.exit(f"mnist-safetensors: {path}: magic {found}, expected {magic}")
    header = 16 if magic == 2051 else 8
    return count, data[header:]


def write(path, tensors):
    header, blobs, at = {}, [], 0
    for name, (shape, blob) in tensors.items():
        header[name] = {"dtype": "U8", "shape": shape, "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    os.replace(tmp, path)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        n, images = idx(os.path.join(src, f"{prefix}-images-idx3-ubyte.gz"), 2051)
        m, labels = idx(os.path.join(src, f"{prefix}-labels-idx1-ubyte.gz"), 2049)
        if n != m or len(images) != n * 784 or len(labels) != n:
            sys.exit(f"mnist-safetensors: {split}: {n} images and {m} labels do not match")
        write(
            os.path.join(out, f"{split}.safetensors"),
            {"image": ([n, 784], images), "label": ([n], labels)},
        )
        print(f"{split}.safetensors: {n} samples")


if __name__ == "__main__":
    main()
