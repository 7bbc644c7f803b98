# W1 sparse-lm (../shared/WORKLOADS.md): an embedding-heavy next-word-style classifier.
# 100000 x 128 embedding over Zipf(1.1) ids; each batch touches ~0.86% of its rows.
model sparse_lm {
  input ids:   i32[B, 8]
  input label: i32[B]

  param emb: f32[100000, 128] = uniform(-0.05, 0.05)
  param w1:  f32[1024, 512]   = glorot
  param b1:  f32[512]         = zeros
  param w2:  f32[512, 1000]   = glorot
  param b2:  f32[1000]        = zeros

  x      = reshape(embedding(emb, ids), [B, 1024])
  h      = relu(x @ w1 + b1)
  logits = h @ w2 + b2
  minimize softmax_cross_entropy(logits, label)
}

train {
  data      = zipf_tokens(vocab = 100000, context = 8, classes = 1000, s = 1.1)
  batch     = 256            # per worker
  optimizer = sgd(lr = 0.1)
  steps     = 200
  seed      = 1001
  eval_samples = 2048
}
