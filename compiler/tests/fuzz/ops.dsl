# Fuzz seed: most of the DSL's ops and initialisers in one small model, on synthetic
# data (no files), so mutations start from a program that reaches every pass.
model ops {
  input x:     f32[B, 12]
  input label: i32[B]

  param w1: f32[12, 16]     = normal(0.0, 0.1)
  param g:  f32[16]         = ones
  param be: f32[16]         = zeros
  param k:  f32[2, 1, 3, 3] = he
  param w2: f32[12, 3]      = uniform(-0.1, 0.1)
  param b2: f32[3]          = zeros

  h0  = layer_norm(matmul(x, w1), g, be, eps = 1e-5)
  h1  = dropout(sigmoid(h0) * tanh(h0) - exp(neg(relu(h0))) / 2.0, rate = 0.1)
  a   = slice(transpose(transpose(h1), [1, 0]), 1, 0, 8)
  img = reshape(x, [B, 1, 3, 4])
  cv  = max_pool2d(relu(conv2d(img, k, stride = 1, padding = 1)), kernel = 2)
  f   = reshape(cv, [B, -1])
  z   = concat([a, f], axis = 1)
  s   = mean(log_softmax(z, axis = -1), axes = [1], keep_dims = true)
  logits = z @ w2 + b2 + s - log(sum(softmax(z), axes = [1], keep_dims = true))
  minimize softmax_cross_entropy(logits, label)
}

train {
  data         = gaussian_classes(features = 12, classes = 3)
  batch        = 8
  optimizer    = sgd(lr = 0.1, momentum = 0.9)
  steps        = 2
  seed         = 5
  eval_every   = 1
  eval_samples = 16
}
