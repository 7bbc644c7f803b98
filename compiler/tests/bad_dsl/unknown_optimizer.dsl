# A small MLP on synthetic data.
model mlp {
  input x:     f32[B, 20]
  input label: i32[B]

  param w1: f32[20, 32] = glorot
  param b1: f32[32]     = zeros
  param w2: f32[32, 4]  = glorot
  param b2: f32[4]      = zeros

  h      = relu(x @ w1 + b1)
  logits = h @ w2 + b2
  minimize softmax_cross_entropy(logits, label)
}

train {
  data      = gaussian_classes(features = 20, classes = 4)
  batch     = 64
  optimizer = adagrad(lr = 0.1)
  steps     = 100
}
