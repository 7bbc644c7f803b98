# Issue 9, A.10: features centred by their mean over the batch, a statistic each
# worker computes on its own samples: `distc verify` must fail and name it.
model batch_centred {
  input x:     f32[B, 6]
  input label: i32[B]

  param w: f32[6, 3] = glorot

  xc = x - mean(x, axes = [0], keep_dims = true)
  minimize softmax_cross_entropy(xc @ w, label)
}

train {
  data      = gaussian_classes(features = 6, classes = 3)
  batch     = 8
  optimizer = sgd(lr = 0.5)
  steps     = 3
  seed      = 1
}
