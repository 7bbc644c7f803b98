# MNIST multi-layer perceptron. Its configured run reaches about 98% test accuracy.
model mlp {
  input image: f32[B, 784]
  input label: i32[B]

  param w1: f32[784, 512] = he
  param b1: f32[512]      = zeros
  param w2: f32[512, 256] = he
  param b2: f32[256]      = zeros
  param w3: f32[256, 10]  = glorot
  param b3: f32[10]       = zeros

  h1     = relu(image @ w1 + b1)
  h2     = relu(h1 @ w2 + b2)
  logits = h2 @ w3 + b3
  minimize softmax_cross_entropy(logits, label)
}

train {
  data       = mnist()
  batch      = 100
  optimizer  = adam(lr = 0.001)
  steps      = 3000          # 5 epochs
  seed       = 1
  eval_every = 1000
}
