# MovieLens 100K rating prediction: user and item embeddings into a small MLP.
model recsys {
  input user:   i32[B]
  input item:   i32[B]
  input rating: f32[B]

  param users: f32[943, 32]  = normal(0.0, 0.1)
  param items: f32[1682, 32] = normal(0.0, 0.1)
  param w1:    f32[64, 64]   = he
  param b1:    f32[64]       = zeros
  param w2:    f32[64, 1]    = glorot
  param b2:    f32[1]        = ones

  x    = concat(embedding(users, user), embedding(items, item), axis = 1)
  h    = relu(x @ w1 + b1)
  pred = reshape(h @ w2 + b2, [B]) + 2.5
  minimize mse(pred, rating)
}

train {
  data       = movielens(test_fraction = 0.1)
  batch      = 128
  optimizer  = adam(lr = 0.002)
  steps      = 1500
  seed       = 11
  eval_every = 500
}
