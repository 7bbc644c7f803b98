model m {
  input x: f32[B, 8]
  input label: i32[B]
  param w: f32[8, 4] = glorot
  minimize softmax_cross_entropy(gelu(x @ w, approximate = "erf"), label)
}
train {
  data = gaussian_classes(features = 8, classes = 4)
  batch = 4
  optimizer = sgd(lr = 0.1)
  steps = 1
}
