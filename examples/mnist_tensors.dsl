# MNIST from safetensors files (scripts/mnist-safetensors.py): the `tensors` source
# reads the arrays named like the inputs; the pixels are stored as bytes and scaled
# here.
#   python3 scripts/mnist-safetensors.py ../shared/data/mnist DATA/mnist-st
#   distc train examples/mnist_tensors.dsl --data DATA
model mnist_tensors {
  input image: f32[B, 784]
  input label: i32[B]

  param w1: f32[784, 256] = he
  param b1: f32[256]      = zeros
  param w2: f32[256, 10]  = glorot
  param b2: f32[10]       = zeros

  x      = image * 0.00392156862745098   # 1/255
  h      = relu(x @ w1 + b1)
  logits = h @ w2 + b2
  minimize softmax_cross_entropy(logits, label)
}

train {
  data       = tensors(path = "mnist-st/train.safetensors", eval_path = "mnist-st/test.safetensors")
  batch      = 100
  optimizer  = adam(lr = 0.001)
  steps      = 600           # 1 epoch
  seed       = 1
  metrics    = [accuracy, top_k(2)]
}
