# Every tensor fits a batch of 2^28 but the logits: 2^32 rows of 10000 classes.
model big {
  input ids:     i32[B, 16]
  input label:   i32[B, 16]

  param emb: f32[10000, 64]  = uniform(-0.05, 0.05)
  param w:   f32[64, 10000]  = glorot

  x      = reshape(embedding(emb, ids), [-1, 64])
  logits = x @ w
  minimize softmax_cross_entropy(logits, reshape(label, [-1]))
}

train {
  data      = tensors(path = "big.safetensors")
  batch     = 268435456
  optimizer = sgd(lr = 0.1)
  steps     = 1
}
