# Issue 9, A.4: labels outside the classes (the data has 10 classes, the model 3).
# Since issue 20, compile refuses it naming `label` and the cross-entropy.
model bad_labels {
  input x:     f32[B, 8]
  input label: i32[B]

  param w: f32[8, 3] = glorot
  param b: f32[3]    = zeros

  minimize softmax_cross_entropy(x @ w + b, label)
}

train {
  data      = gaussian_classes(features = 8, classes = 10)
  batch     = 16
  optimizer = sgd(lr = 0.1)
  steps     = 5
  seed      = 2
}
