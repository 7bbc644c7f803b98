# Penn Treebank next-word model: four words of context, a 10k-row embedding table,
# a tanh hidden layer and a 10000-way softmax. The loss starts at ln(10000) = 9.21.
model lm {
  input context: i32[B, 4]
  input next:    i32[B]

  param emb: f32[10000, 64]  = uniform(-0.1, 0.1)
  param w1:  f32[256, 256]   = glorot
  param b1:  f32[256]        = zeros
  param w2:  f32[256, 10000] = glorot
  param b2:  f32[10000]      = zeros

  x      = reshape(embedding(emb, context), [B, 256])
  h      = tanh(x @ w1 + b1)
  logits = h @ w2 + b2
  minimize softmax_cross_entropy(logits, next)
}

train {
  data         = ptb(context = 4)
  batch        = 64
  optimizer    = adam(lr = 0.002)
  steps        = 1000
  seed         = 3
  eval_every   = 500
  eval_samples = 4096
}
