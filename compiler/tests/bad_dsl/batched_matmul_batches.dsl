model m {
  input x: f32[B, 6]
  input label: i32[B]
  param a: f32[2, 3, 4] = glorot
  param b: f32[3, 4, 5] = glorot
  c = a @ b
  minimize softmax_cross_entropy(x @ reshape(sum(c, axes = [0]), [6, 10]), label)
}
train {
  data = gaussian_classes(features = 6, classes = 10)
  batch = 4
  optimizer = sgd(lr = 0.1)
  steps = 1
}
