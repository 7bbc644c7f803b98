# Issue 9, A.3: a row-sparse gradient with Adam. One device updates only the
# rows a batch touches (lazy Adam); every strategy must do the same, however the
# gradient travels (all-gathered rows, densified all-reduce, parameter servers).
model sparse_adam {
  input ids:   i32[B, 4]
  input label: i32[B]

  param emb: f32[300, 8]  = uniform(-0.1, 0.1)
  param w:   f32[32, 6]   = glorot
  param b:   f32[6]       = zeros

  x      = reshape(embedding(emb, ids), [B, 32])
  logits = x @ w + b
  minimize softmax_cross_entropy(logits, label)
}

train {
  data      = zipf_tokens(vocab = 300, context = 4, classes = 6, s = 1.1)
  batch     = 8
  optimizer = adam(lr = 0.01)
  steps     = 4
  seed      = 3
}
