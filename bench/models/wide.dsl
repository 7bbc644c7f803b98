# A layer that does not fit a small worker: w1 is 1024 x 51200 f32, 200 MiB (issue 23's
# figure: tensor parallelism against ZeRO 3, bench/tensor_parallel.sh). Synthetic data.
model wide {
  input x:     f32[B, 1024]
  input label: i32[B]

  param w1: f32[1024, 51200] = glorot
  param w2: f32[51200, 10]   = glorot

  h = relu(x @ w1)
  minimize softmax_cross_entropy(h @ w2, label)
}

train {
  data      = gaussian_classes(features = 1024, classes = 10)
  batch     = 32
  optimizer = sgd(lr = 0.01)
  steps     = 10
  seed      = 23
}
