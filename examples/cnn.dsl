# A small convolutional network on MNIST (NCHW).
model cnn {
  input image: f32[B, 1, 28, 28]
  input label: i32[B]

  param k1: f32[8, 1, 3, 3]  = he
  param c1: f32[8, 1, 1]     = zeros
  param k2: f32[16, 8, 3, 3] = he
  param c2: f32[16, 1, 1]    = zeros
  param w:  f32[784, 10]     = glorot
  param b:  f32[10]          = zeros

  a1     = max_pool2d(relu(conv2d(image, k1, padding = 1) + c1), kernel = 2)   # [B, 8, 14, 14]
  a2     = max_pool2d(relu(conv2d(a1, k2, padding = 1) + c2), kernel = 2)      # [B, 16, 7, 7]
  logits = reshape(a2, [B, 784]) @ w + b
  minimize softmax_cross_entropy(logits, label)
}

train {
  data         = mnist()
  batch        = 64
  optimizer    = adam(lr = 0.002)
  steps        = 600
  seed         = 7
  eval_every   = 300
  eval_samples = 2000
}
