# Penn Treebank from token files (scripts/ptb-tokens.py): every position of a
# 16-token window predicts the next token from the two before it.
#   python3 scripts/ptb-tokens.py ../shared/data/ptb DATA/ptb-tokens
#   distc train examples/ptb_tokens.dsl --data DATA
model ptb_tokens {
  input tokens:  i32[B, 16]
  input targets: i32[B, 16]

  param emb: f32[10000, 64] = uniform(-0.05, 0.05)
  param w1:  f32[64, 128]   = glorot
  param b1:  f32[128]       = zeros
  param w2:  f32[128, 10000] = glorot
  param b2:  f32[10000]     = zeros

  x      = reshape(embedding(emb, tokens), [-1, 64])
  h      = tanh(x @ w1 + b1)
  logits = h @ w2 + b2
  minimize softmax_cross_entropy(logits, reshape(targets, [-1]))
}

train {
  data      = tokens(path = "ptb-tokens/train.bin", eval_path = "ptb-tokens/valid.bin",
                     dtype = "u16", context = 16)
  batch     = 32
  optimizer = adam(lr = 0.003)
  steps     = 300
  seed      = 5
  eval_samples = 2048
  metrics   = [accuracy, top_k(5), perplexity]
}
