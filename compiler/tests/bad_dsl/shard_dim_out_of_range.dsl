# shard(DIM) names a dimension the variable does not have.
model m {
  input x: f32[B, 8]
  input label: i32[B]
  param w: f32[8, 4] = glorot shard(2)
  minimize softmax_cross_entropy(x @ w, label)
}
train {
  data = gaussian_classes(features = 8, classes = 4)
  batch = 4
  optimizer = sgd(lr = 0.1)
  steps = 1
}
