# Issue 9, A.10: a loss summed over the batch. Data parallelism averages the
# workers' gradients, which matches one device only for a mean over the batch:
# `distc verify` must fail and say so.
model sum_loss {
  input x: f32[B, 6]

  param w: f32[6, 2] = glorot

  minimize sum(tanh(x @ w))
}

train {
  data      = gaussian_classes(features = 6, classes = 3)
  batch     = 8
  optimizer = sgd(lr = 0.05)
  steps     = 3
  seed      = 1
}
