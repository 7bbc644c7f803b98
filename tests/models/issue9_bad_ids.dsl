# Issue 9, A.4: ids outside the table (the data's vocabulary is larger than the
# table). Since issue 20, compile refuses it naming `ids` and the lookup.
model bad_ids {
  input ids:   i32[B, 4]
  input label: i32[B]

  param emb: f32[50, 8] = uniform(-0.1, 0.1)
  param w:   f32[32, 5] = glorot

  x      = reshape(embedding(emb, ids), [B, 32])
  minimize softmax_cross_entropy(x @ w, label)
}

train {
  data      = zipf_tokens(vocab = 5000, context = 4, classes = 5, s = 0.5)
  batch     = 16
  optimizer = sgd(lr = 0.1)
  steps     = 5
  seed      = 2
}
