# Issue 9, A.5: a learning rate that makes the loss overflow. Every run, one device
# or distributed, must stop at the step it happens and name it.
model diverges {
  input x:     f32[B, 16]
  input label: i32[B]

  param w1: f32[16, 64] = glorot
  param w2: f32[64, 4]  = glorot

  minimize softmax_cross_entropy(relu(x @ w1) @ w2, label)
}

train {
  data      = gaussian_classes(features = 16, classes = 4)
  batch     = 16
  optimizer = sgd(lr = 1e30)
  steps     = 20
  seed      = 4
  eval_every = 2
}
