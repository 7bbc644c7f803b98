# A GPT-2-style decoder: 4 blocks, width 128, 4 heads, context 64,
# vocabulary 10000; written by scripts/gpt-dsl.py (run it for other sizes).
#   python3 scripts/ptb-tokens.py ../shared/data/ptb DATA/ptb-tokens
#   distc train examples/gpt.dsl --data DATA
model gpt {
  input tokens:  i32[B, 64]
  input targets: i32[B, 64]

  param wte: f32[10000, 128] = normal(0, 0.02)
  param wpe: f32[64, 128] = normal(0, 0.02)
  param h0_ln1_g: f32[128] = ones
  param h0_ln1_b: f32[128] = zeros
  param h0_wq: f32[128, 128] = normal(0, 0.02)
  param h0_bq: f32[128] = zeros
  param h0_wk: f32[128, 128] = normal(0, 0.02)
  param h0_wv: f32[128, 128] = normal(0, 0.02)
  param h0_bv: f32[128] = zeros
  param h0_wo: f32[128, 128] = normal(0, 0.00707107)
  param h0_bo: f32[128] = zeros
  param h0_ln2_g: f32[128] = ones
  param h0_ln2_b: f32[128] = zeros
  param h0_wfc: f32[128, 512] = normal(0, 0.02)
  param h0_bfc: f32[512] = zeros
  param h0_wproj: f32[512, 128] = normal(0, 0.00707107)
  param h0_bproj: f32[128] = zeros
  param h1_ln1_g: f32[128] = ones
  param h1_ln1_b: f32[128] = zeros
  param h1_wq: f32[128, 128] = normal(0, 0.02)
  param h1_bq: f32[128] = zeros
  param h1_wk: f32[128, 128] = normal(0, 0.02)
  param h1_wv: f32[128, 128] = normal(0, 0.02)
  param h1_bv: f32[128] = zeros
  param h1_wo: f32[128, 128] = normal(0, 0.00707107)
  param h1_bo: f32[128] = zeros
  param h1_ln2_g: f32[128] = ones
  param h1_ln2_b: f32[128] = zeros
  param h1_wfc: f32[128, 512] = normal(0, 0.02)
  param h1_bfc: f32[512] = zeros
  param h1_wproj: f32[512, 128] = normal(0, 0.00707107)
  param h1_bproj: f32[128] = zeros
  param h2_ln1_g: f32[128] = ones
  param h2_ln1_b: f32[128] = zeros
  param h2_wq: f32[128, 128] = normal(0, 0.02)
  param h2_bq: f32[128] = zeros
  param h2_wk: f32[128, 128] = normal(0, 0.02)
  param h2_wv: f32[128, 128] = normal(0, 0.02)
  param h2_bv: f32[128] = zeros
  param h2_wo: f32[128, 128] = normal(0, 0.00707107)
  param h2_bo: f32[128] = zeros
  param h2_ln2_g: f32[128] = ones
  param h2_ln2_b: f32[128] = zeros
  param h2_wfc: f32[128, 512] = normal(0, 0.02)
  param h2_bfc: f32[512] = zeros
  param h2_wproj: f32[512, 128] = normal(0, 0.00707107)
  param h2_bproj: f32[128] = zeros
  param h3_ln1_g: f32[128] = ones
  param h3_ln1_b: f32[128] = zeros
  param h3_wq: f32[128, 128] = normal(0, 0.02)
  param h3_bq: f32[128] = zeros
  param h3_wk: f32[128, 128] = normal(0, 0.02)
  param h3_wv: f32[128, 128] = normal(0, 0.02)
  param h3_bv: f32[128] = zeros
  param h3_wo: f32[128, 128] = normal(0, 0.00707107)
  param h3_bo: f32[128] = zeros
  param h3_ln2_g: f32[128] = ones
  param h3_ln2_b: f32[128] = zeros
  param h3_wfc: f32[128, 512] = normal(0, 0.02)
  param h3_bfc: f32[512] = zeros
  param h3_wproj: f32[512, 128] = normal(0, 0.00707107)
  param h3_bproj: f32[128] = zeros
  param lnf_g: f32[128] = ones
  param lnf_b: f32[128] = zeros

  x0 = embedding(wte, tokens) + wpe
  a0 = layer_norm(x0, h0_ln1_g, h0_ln1_b)
  q0 = transpose(reshape(a0 @ h0_wq + h0_bq, [B, 64, 4, 32]), [0, 2, 1, 3])
  k0 = transpose(reshape(a0 @ h0_wk, [B, 64, 4, 32]), [0, 2, 1, 3])
  v0 = transpose(reshape(a0 @ h0_wv + h0_bv, [B, 64, 4, 32]), [0, 2, 1, 3])
  y0 = reshape(transpose(attention(q0, k0, v0, causal = true), [0, 2, 1, 3]), [B, 64, 128])
  r0 = x0 + y0 @ h0_wo + h0_bo
  m0 = layer_norm(r0, h0_ln2_g, h0_ln2_b)
  x1 = r0 + gelu(m0 @ h0_wfc + h0_bfc, approximate = "tanh") @ h0_wproj + h0_bproj
  a1 = layer_norm(x1, h1_ln1_g, h1_ln1_b)
  q1 = transpose(reshape(a1 @ h1_wq + h1_bq, [B, 64, 4, 32]), [0, 2, 1, 3])
  k1 = transpose(reshape(a1 @ h1_wk, [B, 64, 4, 32]), [0, 2, 1, 3])
  v1 = transpose(reshape(a1 @ h1_wv + h1_bv, [B, 64, 4, 32]), [0, 2, 1, 3])
  y1 = reshape(transpose(attention(q1, k1, v1, causal = true), [0, 2, 1, 3]), [B, 64, 128])
  r1 = x1 + y1 @ h1_wo + h1_bo
  m1 = layer_norm(r1, h1_ln2_g, h1_ln2_b)
  x2 = r1 + gelu(m1 @ h1_wfc + h1_bfc, approximate = "tanh") @ h1_wproj + h1_bproj
  a2 = layer_norm(x2, h2_ln1_g, h2_ln1_b)
  q2 = transpose(reshape(a2 @ h2_wq + h2_bq, [B, 64, 4, 32]), [0, 2, 1, 3])
  k2 = transpose(reshape(a2 @ h2_wk, [B, 64, 4, 32]), [0, 2, 1, 3])
  v2 = transpose(reshape(a2 @ h2_wv + h2_bv, [B, 64, 4, 32]), [0, 2, 1, 3])
  y2 = reshape(transpose(attention(q2, k2, v2, causal = true), [0, 2, 1, 3]), [B, 64, 128])
  r2 = x2 + y2 @ h2_wo + h2_bo
  m2 = layer_norm(r2, h2_ln2_g, h2_ln2_b)
  x3 = r2 + gelu(m2 @ h2_wfc + h2_bfc, approximate = "tanh") @ h2_wproj + h2_bproj
  a3 = layer_norm(x3, h3_ln1_g, h3_ln1_b)
  q3 = transpose(reshape(a3 @ h3_wq + h3_bq, [B, 64, 4, 32]), [0, 2, 1, 3])
  k3 = transpose(reshape(a3 @ h3_wk, [B, 64, 4, 32]), [0, 2, 1, 3])
  v3 = transpose(reshape(a3 @ h3_wv + h3_bv, [B, 64, 4, 32]), [0, 2, 1, 3])
  y3 = reshape(transpose(attention(q3, k3, v3, causal = true), [0, 2, 1, 3]), [B, 64, 128])
  r3 = x3 + y3 @ h3_wo + h3_bo
  m3 = layer_norm(r3, h3_ln2_g, h3_ln2_b)
  x4 = r3 + gelu(m3 @ h3_wfc + h3_bfc, approximate = "tanh") @ h3_wproj + h3_bproj
  f = layer_norm(x4, lnf_g, lnf_b)
  logits = matmul(f, wte, transpose_b = true)
  minimize softmax_cross_entropy(logits, targets)
}

train {
  data      = tokens(path = "ptb-tokens/train.bin", eval_path = "ptb-tokens/valid.bin",
                     dtype = "u16", context = 64)
  batch     = 16
  optimizer = adamw(lr = 0.002, beta1 = 0.9, beta2 = 0.95, weight_decay = 0.1)
  decay_min_rank = 2
  clip_norm = 1.0
  lr_schedule = cosine(warmup = 30, final = 0.1)
  steps     = 600
  seed      = 1
  eval_every   = 0
  eval_samples = 4096
  metrics   = [accuracy, perplexity]
}
