model m {
  input x: f32[B, 16]
  input label: i32[B]
  param w: f32[16, 16] = glorot
  q = reshape(x @ w, [B, 2, 8])
  k = reshape(x @ w, [B, 4, 4])
  a = attention(q, k, q, causal = true)
  minimize softmax_cross_entropy(reshape(a, [B, 16]), label)
}
train {
  data = gaussian_classes(features = 16, classes = 16)
  batch = 4
  optimizer = sgd(lr = 0.1)
  steps = 1
}
