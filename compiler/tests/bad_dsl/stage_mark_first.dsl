# A pipeline_stage marker before any variable is used: stage 0 would hold nothing.
model mlp {
  input x:     f32[B, 20]
  input label: i32[B]

  param w1: f32[20, 32] = glorot
  param w2: f32[32, 4]  = glorot

  pipeline_stage
  h      = relu(x @ w1)
  logits = h @ w2
  minimize softmax_cross_entropy(logits, label)
}

train {
  data      = gaussian_classes(features = 20, classes = 4)
  batch     = 8
  optimizer = sgd(lr = 0.1)
  steps     = 10
  seed      = 1
}
