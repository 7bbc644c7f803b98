# A deep MLP for pipeline parallelism (--pipeline P): ten layers, each a matmul, a bias
# and a tanh, on MNIST. Deep enough to cut into 2, 4 or 8 stages of
# whole layers.
model deep_mlp {
  input image: f32[B, 784]
  input label: i32[B]

  param w1:  f32[784, 256] = glorot
  param b1:  f32[256]      = zeros
  param w2:  f32[256, 256] = glorot
  param b2:  f32[256]      = zeros
  param w3:  f32[256, 256] = glorot
  param b3:  f32[256]      = zeros
  param w4:  f32[256, 256] = glorot
  param b4:  f32[256]      = zeros
  param w5:  f32[256, 256] = glorot
  param b5:  f32[256]      = zeros
  param w6:  f32[256, 256] = glorot
  param b6:  f32[256]      = zeros
  param w7:  f32[256, 256] = glorot
  param b7:  f32[256]      = zeros
  param w8:  f32[256, 256] = glorot
  param b8:  f32[256]      = zeros
  param w9:  f32[256, 256] = glorot
  param b9:  f32[256]      = zeros
  param w10: f32[256, 10]  = glorot
  param b10: f32[10]       = zeros

  h1     = tanh(image @ w1 + b1)
  h2     = tanh(h1 @ w2 + b2)
  h3     = tanh(h2 @ w3 + b3)
  h4     = tanh(h3 @ w4 + b4)
  h5     = tanh(h4 @ w5 + b5)
  h6     = tanh(h5 @ w6 + b6)
  h7     = tanh(h6 @ w7 + b7)
  h8     = tanh(h7 @ w8 + b8)
  h9     = tanh(h8 @ w9 + b9)
  logits = h9 @ w10 + b10
  minimize softmax_cross_entropy(logits, label)
}

train {
  data      = mnist()
  batch     = 64
  optimizer = sgd(lr = 0.1)
  steps     = 2000
  seed      = 2201
  eval_every = 500
}
