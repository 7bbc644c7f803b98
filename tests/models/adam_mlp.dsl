# A three-layer perceptron trained by Adam on synthetic classes (no data files): the
# shape of examples/mlp.dsl, for tests whose optimizer slots must be split and joined
# again (sharded states, stages on a model axis).
model adam_mlp {
  input x: f32[B, 64]
  input label: i32[B]

  param w1: f32[64, 128] = he
  param b1: f32[128]     = zeros
  param w2: f32[128, 64] = he
  param b2: f32[64]      = zeros
  param w3: f32[64, 10]  = glorot
  param b3: f32[10]      = zeros

  h1     = relu(x @ w1 + b1)
  h2     = relu(h1 @ w2 + b2)
  logits = h2 @ w3 + b3
  minimize softmax_cross_entropy(logits, label)
}

train {
  data      = gaussian_classes(features = 64, classes = 10)
  batch     = 32
  optimizer = adam(lr = 0.001)
  steps     = 100
  seed      = 3
}
