# Issue 9, A.2: dropout under data parallelism. Each sample's mask must follow its
# position in the global batch, so N workers of batch b drop what one device of
# batch N*b drops.
model dropout_mlp {
  input x:     f32[B, 20]
  input label: i32[B]

  param w1: f32[20, 32] = glorot
  param b1: f32[32]     = zeros
  param w2: f32[32, 4]  = glorot
  param b2: f32[4]      = zeros

  h      = dropout(relu(x @ w1 + b1), rate = 0.3)
  logits = h @ w2 + b2
  minimize softmax_cross_entropy(logits, label)
}

train {
  data      = gaussian_classes(features = 20, classes = 4)
  batch     = 8
  optimizer = sgd(lr = 0.1)
  steps     = 5
  seed      = 9
}
