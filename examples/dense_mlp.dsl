# W2 dense-mlp (../shared/WORKLOADS.md): an MNIST-shaped MLP on synthetic data.
model dense_mlp {
  input x:     f32[B, 784]
  input label: i32[B]

  param w1: f32[784, 1024]  = glorot
  param b1: f32[1024]       = zeros
  param w2: f32[1024, 1024] = glorot
  param b2: f32[1024]       = zeros
  param w3: f32[1024, 10]   = glorot
  param b3: f32[10]         = zeros

  h1     = relu(x @ w1 + b1)
  h2     = relu(h1 @ w2 + b2)
  logits = h2 @ w3 + b3
  minimize softmax_cross_entropy(logits, label)
}

train {
  data      = gaussian_classes(features = 784, classes = 10)
  batch     = 128
  optimizer = sgd(lr = 0.05)
  steps     = 100
  seed      = 2001
  eval_samples = 1024
}
