# A small residual network with batch normalisation on MNIST (NCHW): a stem, one
# block at 16 channels, one that halves the image to 14x14 at 32 channels (its skip
# a strided 1x1 convolution), global average pooling and a linear classifier. Each
# batch_norm keeps its running statistics as the frozen variables
# `<gamma>_running_mean` and `<gamma>_running_var`, which evaluation uses.
model resnet {
  input image: f32[B, 1, 28, 28]
  input label: i32[B]

  param stem: f32[16, 1, 3, 3]  = he
  param g0:   f32[16]           = ones
  param b0:   f32[16]           = zeros

  param k1a:  f32[16, 16, 3, 3] = he
  param g1a:  f32[16]           = ones
  param b1a:  f32[16]           = zeros
  param k1b:  f32[16, 16, 3, 3] = he
  param g1b:  f32[16]           = ones
  param b1b:  f32[16]           = zeros

  param k2a:  f32[32, 16, 3, 3] = he
  param g2a:  f32[32]           = ones
  param b2a:  f32[32]           = zeros
  param k2b:  f32[32, 32, 3, 3] = he
  param g2b:  f32[32]           = ones
  param b2b:  f32[32]           = zeros
  param k2s:  f32[32, 16, 1, 1] = he
  param g2s:  f32[32]           = ones
  param b2s:  f32[32]           = zeros

  param w:    f32[32, 10]       = glorot
  param b:    f32[10]           = zeros

  h0 = relu(batch_norm(conv2d(image, stem, padding = 1), g0, b0))                 # [B, 16, 28, 28]

  h1 = relu(batch_norm(conv2d(h0, k1a, padding = 1), g1a, b1a))
  r1 = relu(batch_norm(conv2d(h1, k1b, padding = 1), g1b, b1b) + h0)               # [B, 16, 28, 28]

  h2 = relu(batch_norm(conv2d(r1, k2a, stride = 2, padding = 1), g2a, b2a))        # [B, 32, 14, 14]
  s2 = batch_norm(conv2d(r1, k2s, stride = 2), g2s, b2s)
  r2 = relu(batch_norm(conv2d(h2, k2b, padding = 1), g2b, b2b) + s2)

  logits = mean(r2, axes = [2, 3]) @ w + b                                         # [B, 10]
  minimize softmax_cross_entropy(logits, label)
}

train {
  data         = mnist()
  batch        = 32
  optimizer    = sgd(lr = 0.05, momentum = 0.9)
  steps        = 300
  seed         = 7
  eval_every   = 150
  eval_samples = 2000
}
