model m {
  input x: f32[B, 8]
  input label: i32[B]
  param w: f32[8, 4] = glorot
  param bias: f32[4] = zeros
  minimize softmax_cross_entropy(x @ w + bias, label)
}
train {
  data = gaussian_classes(features = 8, classes = 4)
  batch = 4
  optimizer = adamw(lr = 0.01, weight_decay = 0.1)
  no_decay = [w, biass]
  steps = 1
}
