// Fused selective log-softmax on CPU: per-token log-probabilities and entropies of a linear LM head without the
// (N, V) logits, forward and backward. The math and the Python-side contract are documented in
// grpo_mem/ops/logprobs.py (this file is its "cpp" backend); the algorithm follows Apple's Cut Cross-Entropy
// (arXiv 2411.09009): tile GEMM, online max / sum-exp statistics, recompute in the backward.
//
// Layout: GEMM tiles of BLOCK_N tokens x BLOCK_V vocabulary entries go through ATen's BLAS (fp32 accumulation, fp32
// output; bf16/fp16 operands are widened block by block). Each tile row is then folded by one vectorised pass
// (at::vec::Vectorized, Sleef exp/tanh), rows split across threads with at::parallel_for.
// Determinism: every reduction runs in a fixed order (vocabulary blocks in order, rows owned by one thread), so the
// results are bitwise reproducible for a fixed thread count.
//
// Built with -mavx2 -mfma and CPU_CAPABILITY=AVX2 (setup.py); grpo_mem/ops/_ext.py only loads it on CPUs torch
// reports as AVX2 or AVX512 capable.
//
// The ops are registered with the dispatcher as torch.ops.grpo_mem.* (TORCH_LIBRARY below, CPU kernels here; their
// fake/meta kernels are registered from Python in grpo_mem/ops/logprobs.py), so torch.compile and FakeTensor see
// them. Tile sizes are arguments of every op: the one tile policy is grpo_mem.ops.logprobs._cpp_blocks.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// rows per parallel task in the elementwise passes
constexpr int64_t ROW_GRAIN = 16;

struct Head {
  float scale;   // logit_scale
  float cap;     // final soft cap (unused when !has_cap)
  float inv_t;   // 1 / temperature
  bool has_cap;
};

inline float hmax(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v);
}
inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// z = transform(a) in place over one row (TRL 1.16 order: scale, soft cap, 1/T); returns max z.
inline float transform_row(float* a, int64_t c, const Head& hd) {
  Vec vmax(kNegInf);
  float smax = kNegInf;
  int64_t j = 0;
  if (!hd.has_cap) {
    const float k = hd.scale * hd.inv_t;
    const Vec vk(k);
    for (; j + kLanes <= c; j += kLanes) {
      Vec z = Vec::loadu(a + j) * vk;
      z.store(a + j);
      vmax = at::vec::maximum(vmax, z);
    }
    for (; j < c; ++j) {
      a[j] *= k;
      smax = std::max(smax, a[j]);
    }
  } else {
    const float k1 = hd.scale / hd.cap, k2 = hd.cap * hd.inv_t;
    const Vec vk1(k1), vk2(k2);
    for (; j + kLanes <= c; j += kLanes) {
      Vec z = (Vec::loadu(a + j) * vk1).tanh() * vk2;
      z.store(a + j);
      vmax = at::vec::maximum(vmax, z);
    }
    for (; j < c; ++j) {
      a[j] = std::tanh(a[j] * k1) * k2;
      smax = std::max(smax, a[j]);
    }
  }
  return std::max(smax, hmax(vmax));
}

// Elements per partial sum of fold_row: each lane adds at most FOLD_CHUNK / kLanes terms in fp32 before the chunk's
// lanes go into a double accumulator. One long fp32 sum per lane (6144 terms per lane for SmolLM2's 49152 entries in
// one block) rounded the row's sum-exp to a relative error of a few 1e-6, which every log-prob, entropy and
// gradient of the head inherits; chunked, it is a few 1e-7, as close to the exact sum as ATen's cascade sum (see
// docs/kernels.md, "fp32 accuracy").
constexpr int64_t FOLD_CHUNK = 32 * kLanes;

// Fold one transformed row z[0:c) into the running statistics (m, s, sz):
// s = sum exp(z - m), sz = sum exp(z - m) * (z - m), so that entropy = log s - sz / s without cancellation.
// The block's sums are formed in chunks of FOLD_CHUNK elements (vector fp32 partial sums) added in double.
// z may hold -inf (masked vocabulary): while a row has no finite value, nm = -inf and 0 is subtracted instead
// (-inf - (-inf) is NaN); d is clamped to -FLT_MAX so that e = 0 and e * d = 0 rather than 0 * (-inf) = NaN.
inline void fold_row(const float* z, int64_t c, float zmax, float& m, float& s, float& sz, bool want_entropy) {
  const float nm = std::max(m, zmax);
  const float ref = nm == kNegInf ? 0.f : nm;
  const float lowest = std::numeric_limits<float>::lowest();
  const Vec vnm(ref), vlow(lowest);
  double ts = 0.0, tsz = 0.0;
  for (int64_t c0 = 0; c0 < c; c0 += FOLD_CHUNK) {
    const int64_t c1 = std::min(c, c0 + FOLD_CHUNK);
    Vec vs(0.f), vsz(0.f);
    float rs = 0.f, rsz = 0.f;
    int64_t j = c0;
    if (want_entropy) {
      for (; j + kLanes <= c1; j += kLanes) {
        Vec d = at::vec::maximum(Vec::loadu(z + j) - vnm, vlow);
        Vec e = d.exp();
        vs = vs + e;
        vsz = at::vec::fmadd(e, d, vsz);
      }
      for (; j < c1; ++j) {
        float d = std::max(z[j] - ref, lowest), e = std::exp(d);
        rs += e;
        rsz += e * d;
      }
      tsz += double(hsum(vsz)) + double(rsz);
    } else {
      for (; j + kLanes <= c1; j += kLanes) vs = vs + (Vec::loadu(z + j) - vnm).exp();
      for (; j < c1; ++j) rs += std::exp(z[j] - ref);
    }
    ts += double(hsum(vs)) + double(rs);
  }
  if (s > 0.f) {  // s == 0 while m = -inf (before the first block, or while every value so far was -inf)
    const float alpha = std::exp(m - nm);
    if (want_entropy) sz = alpha * (sz + (m - nm) * s) + float(tsz);
    s = alpha * s + float(ts);
  } else {
    if (want_entropy) sz = float(tsz);
    s = float(ts);
  }
  m = nm;
}

// Overwrite one row a[0:c) of pre-scale logits with d(loss)/d(a), loss = g_lp * logp + g_ent * entropy:
// dz = -p * (g_lp + g_ent * (log p + H)) off target, dz_y = g_lp * (-expm1(log p_y)) - g_ent * p_y * (log p_y + H),
// times the chain d z / d a = inv_t * (1 - tanh^2) * scale.
inline void grad_row(float* a, int64_t c, int64_t local, float lse, float ent, float g_lp, float g_ent,
                     const Head& hd) {
  if (g_lp == 0.f && g_ent == 0.f) {
    std::fill(a, a + c, 0.f);
    return;
  }
  const bool has_target = local >= 0 && local < c;
  const float a_y = has_target ? a[local] : 0.f;
  const float c0 = g_lp + g_ent * ent;
  const Vec vlse(lse), vc0(c0), vge(g_ent);
  int64_t j = 0;
  if (!hd.has_cap) {
    const float k = hd.scale * hd.inv_t;
    const Vec vk(k), vnk(-k), zero(0.f);
    // p = 0 gives exactly 0: at a -inf logit (masked vocabulary) p * (c0 + g_ent * lp) would be 0 * (-inf) = NaN
    for (; j + kLanes <= c; j += kLanes) {
      Vec lp = Vec::loadu(a + j) * vk - vlse;
      Vec p = lp.exp();
      Vec::blendv(zero, p * at::vec::fmadd(vge, lp, vc0) * vnk, p > zero).store(a + j);
    }
    for (; j < c; ++j) {
      float lp = a[j] * k - lse, p = std::exp(lp);
      a[j] = p > 0.f ? -k * p * (c0 + g_ent * lp) : 0.f;
    }
  } else {
    const float k1 = hd.scale / hd.cap, k2 = hd.cap * hd.inv_t, kc = -hd.inv_t * hd.scale;
    const Vec vk1(k1), vk2(k2), vkc(kc), one(1.f);
    for (; j + kLanes <= c; j += kLanes) {
      Vec t = (Vec::loadu(a + j) * vk1).tanh();
      Vec lp = t * vk2 - vlse;
      Vec p = lp.exp();
      (p * at::vec::fmadd(vge, lp, vc0) * vkc * (one - t * t)).store(a + j);
    }
    for (; j < c; ++j) {
      float t = std::tanh(a[j] * k1), lp = t * k2 - lse, p = std::exp(lp);
      a[j] = kc * p * (c0 + g_ent * lp) * (1.f - t * t);
    }
  }
  if (has_target) {
    float chain, lp;
    if (hd.has_cap) {
      float t = std::tanh(a_y * hd.scale / hd.cap);
      lp = t * hd.cap * hd.inv_t - lse;
      chain = hd.inv_t * hd.scale * (1.f - t * t);
    } else {
      lp = a_y * hd.scale * hd.inv_t - lse;
      chain = hd.scale * hd.inv_t;
    }
    const float dz = g_lp * -std::expm1(lp) - g_ent * std::exp(lp) * (lp + ent);
    a[local] = dz * chain;
  }
}

void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// fp32 view of rows [r0, r1) of a 2-D tensor: a view when already fp32, else a widened copy.
inline Tensor rows_f32(const Tensor& x, int64_t r0, int64_t r1) {
  Tensor v = x.narrow(0, r0, r1 - r0);
  return v.scalar_type() == at::kFloat ? v : v.to(at::kFloat);
}

// tile = h @ w^T (+ b), fp32, written into `tile` (n, c) which is a contiguous slice of the tile buffer
inline void gemm_tile(Tensor& tile, const Tensor& h, const Tensor& w, const c10::optional<Tensor>& b) {
  if (b.has_value()) {
    tile.copy_(b->unsqueeze(0).expand_as(tile));
    tile.addmm_(h, w.t());
  } else {
    at::mm_out(tile, h, w.t());
  }
}

using Three = std::tuple<Tensor, Tensor, Tensor>;

Three finish(const Tensor& m, const Tensor& s, const Tensor& sz, const Tensor& zy, const Tensor& target,
             bool want_entropy) {
  Tensor valid = target.ge(0);
  Tensor log_s = s.log();
  Tensor lse = m + log_s;
  Tensor zero = at::zeros({}, m.options());
  Tensor logp = at::where(valid, zy - lse, zero);
  Tensor ent = want_entropy ? at::where(valid, log_s - sz / s, zero) : at::empty({0}, m.options());
  return {logp, ent, lse};
}

}  // namespace

// Forward. hidden (N, H), weight (V, H) same float dtype; bias (V,) or None; target (N,) int64 with -1 = ignored.
// Returns (logp (N,), entropy (N,) or (0,), lse (N,)), fp32.
Three linear_logprobs_fwd(const Tensor& hidden, const Tensor& weight, const c10::optional<Tensor>& bias,
                                        const Tensor& target, double scale, double cap, double inv_t, bool has_cap,
                                        bool want_entropy, int64_t block_n, int64_t block_v) {
  TORCH_CHECK(block_n > 0 && block_v > 0, "block sizes must be positive, got ", block_n, " x ", block_v);
  check_cpu(hidden, "hidden");
  check_cpu(weight, "weight");
  check_cpu(target, "target");
  TORCH_CHECK(target.scalar_type() == at::kLong, "target must be int64");
  const int64_t N = hidden.size(0), V = weight.size(0);
  const Head hd{float(scale), float(cap), float(inv_t), has_cap};
  auto f32 = hidden.options().dtype(at::kFloat);
  Tensor m = at::full({N}, kNegInf, f32), s = at::zeros({N}, f32), sz = at::zeros({N}, f32), zy = at::zeros({N}, f32);
  c10::optional<Tensor> b32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  Tensor buf = at::empty({std::min(N, block_n) * std::min(V, block_v)}, f32);
  const int64_t* tgt = target.data_ptr<int64_t>();
  float *pm = m.data_ptr<float>(), *ps = s.data_ptr<float>(), *psz = sz.data_ptr<float>(), *pzy = zy.data_ptr<float>();

  for (int64_t n0 = 0; n0 < N; n0 += block_n) {
    const int64_t n1 = std::min(N, n0 + block_n), n = n1 - n0;
    Tensor h = rows_f32(hidden, n0, n1);
    for (int64_t v0 = 0; v0 < V; v0 += block_v) {
      const int64_t v1 = std::min(V, v0 + block_v), c = v1 - v0;
      Tensor tile = buf.narrow(0, 0, n * c).view({n, c});
      c10::optional<Tensor> bb;
      if (b32.has_value()) bb = b32->narrow(0, v0, c);
      gemm_tile(tile, h, rows_f32(weight, v0, v1), bb);
      float* t = tile.data_ptr<float>();
      at::parallel_for(0, n, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          float* row = t + r * c;
          const int64_t i = n0 + r;
          const float zmax = transform_row(row, c, hd);
          const int64_t local = tgt[i] - v0;
          if (tgt[i] >= 0 && local >= 0 && local < c) pzy[i] = row[local];
          fold_row(row, c, zmax, pm[i], ps[i], psz[i], want_entropy);
        }
      });
    }
  }
  return finish(m, s, sz, zy, target, want_entropy);
}

// Backward. g_lp / g_ent: (N,) fp32 upstream gradients (zero on ignored rows) or None. Vocabulary blocks outer,
// token blocks inner: each d_weight block is complete after its inner loop, so a non-fp32 weight needs only a
// (block_v, H) fp32 accumulator; d_hidden accumulates in an (N, H) fp32 buffer. Returns (dh, dw, db) in the inputs'
// dtypes ((0,) where not requested: the dispatcher takes no undefined tensor).
Three linear_logprobs_bwd(const Tensor& hidden, const Tensor& weight, const c10::optional<Tensor>& bias,
                                        const Tensor& target, const Tensor& lse, const c10::optional<Tensor>& ent,
                                        const c10::optional<Tensor>& g_lp, const c10::optional<Tensor>& g_ent,
                                        double scale, double cap, double inv_t, bool has_cap, bool need_dh,
                                        bool need_dw, bool need_db, int64_t block_n, int64_t block_v) {
  TORCH_CHECK(block_n > 0 && block_v > 0, "block sizes must be positive, got ", block_n, " x ", block_v);
  check_cpu(hidden, "hidden");
  check_cpu(weight, "weight");
  TORCH_CHECK(g_lp.has_value() || g_ent.has_value(), "need at least one upstream gradient");
  TORCH_CHECK(!g_ent.has_value() || ent.has_value(), "entropy gradient given without saved entropies");
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  const Head hd{float(scale), float(cap), float(inv_t), has_cap};
  auto f32 = hidden.options().dtype(at::kFloat);
  need_db = need_db && bias.has_value();
  Tensor dh = need_dh ? at::zeros({N, H}, f32) : Tensor();
  Tensor dw = need_dw ? at::empty_like(weight) : Tensor();
  Tensor db = need_db ? at::empty_like(*bias) : Tensor();
  const bool dw_direct = need_dw && weight.scalar_type() == at::kFloat;
  Tensor dw_acc = (need_dw && !dw_direct) ? at::empty({std::min(V, block_v), H}, f32) : Tensor();
  Tensor db_acc = need_db ? at::empty({std::min(V, block_v)}, f32) : Tensor();
  c10::optional<Tensor> b32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  Tensor buf = at::empty({std::min(N, block_n) * std::min(V, block_v)}, f32);
  // widen the hidden states once per call only when they are not fp32 and there is more than one vocabulary block
  Tensor h_all = (hidden.scalar_type() != at::kFloat && V > block_v) ? hidden.to(at::kFloat) : hidden;

  const int64_t* tgt = target.data_ptr<int64_t>();
  const float* plse = lse.data_ptr<float>();
  const float* pent = ent.has_value() ? ent->data_ptr<float>() : nullptr;
  const float* pglp = g_lp.has_value() ? g_lp->data_ptr<float>() : nullptr;
  const float* pgent = g_ent.has_value() ? g_ent->data_ptr<float>() : nullptr;

  for (int64_t v0 = 0; v0 < V; v0 += block_v) {
    const int64_t v1 = std::min(V, v0 + block_v), c = v1 - v0;
    Tensor w = rows_f32(weight, v0, v1);
    c10::optional<Tensor> bb;
    if (b32.has_value()) bb = b32->narrow(0, v0, c);
    Tensor dwb;
    if (need_dw) {
      dwb = dw_direct ? dw.narrow(0, v0, c) : dw_acc.narrow(0, 0, c);
      dwb.zero_();
    }
    Tensor dbb;
    if (need_db) {
      dbb = db_acc.narrow(0, 0, c);
      dbb.zero_();
    }
    for (int64_t n0 = 0; n0 < N; n0 += block_n) {
      const int64_t n1 = std::min(N, n0 + block_n), n = n1 - n0;
      Tensor h = rows_f32(h_all, n0, n1);
      Tensor tile = buf.narrow(0, 0, n * c).view({n, c});
      gemm_tile(tile, h, w, bb);
      float* t = tile.data_ptr<float>();
      at::parallel_for(0, n, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t i = n0 + r;
          grad_row(t + r * c, c, tgt[i] - v0, plse[i], pent ? pent[i] : 0.f, pglp ? pglp[i] : 0.f,
                   pgent ? pgent[i] : 0.f, hd);
        }
      });
      if (need_dh) dh.narrow(0, n0, n).addmm_(tile, w);
      if (need_dw) dwb.addmm_(tile.t(), h);
      if (need_db) dbb.add_(tile.sum(0));
    }
    if (need_dw && !dw_direct) dw.narrow(0, v0, c).copy_(dwb);
    if (need_db) db.narrow(0, v0, c).copy_(dbb);
  }
  if (need_dh && hidden.scalar_type() != at::kFloat) dh = dh.to(hidden.scalar_type());
  auto none = [&](const Tensor& t, const Tensor& like) { return t.defined() ? t : at::empty({0}, like.options()); };
  return {none(dh, hidden), none(dw, weight), none(db, bias.has_value() ? *bias : weight)};
}

// selective_log_softmax forward over given logits (N, V) of any float dtype; rows folded in block_v column blocks.
Three selective_log_softmax_fwd(const Tensor& logits, const Tensor& target, double inv_t, bool want_entropy,
                                int64_t block_v) {
  TORCH_CHECK(block_v > 0, "block_v must be positive, got ", block_v);
  check_cpu(logits, "logits");
  const int64_t N = logits.size(0), V = logits.size(1);
  const Head hd{1.f, 0.f, float(inv_t), false};
  auto f32 = logits.options().dtype(at::kFloat);
  Tensor m = at::full({N}, kNegInf, f32), s = at::zeros({N}, f32), sz = at::zeros({N}, f32), zy = at::zeros({N}, f32);
  const int64_t* tgt = target.data_ptr<int64_t>();
  float *pm = m.data_ptr<float>(), *ps = s.data_ptr<float>(), *psz = sz.data_ptr<float>(), *pzy = zy.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "selective_log_softmax_fwd", [&] {
    const scalar_t* src = logits.data_ptr<scalar_t>();
    at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
      std::vector<float> row(std::min(V, block_v));
      for (int64_t i = r0; i < r1; ++i) {
        for (int64_t v0 = 0; v0 < V; v0 += block_v) {
          const int64_t c = std::min(V, v0 + block_v) - v0;
          const scalar_t* x = src + i * V + v0;
          for (int64_t j = 0; j < c; ++j) row[j] = static_cast<float>(x[j]);
          const float zmax = transform_row(row.data(), c, hd);
          const int64_t local = tgt[i] - v0;
          if (tgt[i] >= 0 && local >= 0 && local < c) pzy[i] = row[local];
          fold_row(row.data(), c, zmax, pm[i], ps[i], psz[i], want_entropy);
        }
      }
    });
  });
  return finish(m, s, sz, zy, target, want_entropy);
}

// selective_log_softmax backward: d_logits (N, V) in the dtype of `logits`.
Tensor selective_log_softmax_bwd(const Tensor& logits, const Tensor& target, const Tensor& lse,
                                 const c10::optional<Tensor>& ent, const c10::optional<Tensor>& g_lp,
                                 const c10::optional<Tensor>& g_ent, double inv_t, int64_t block_v) {
  TORCH_CHECK(block_v > 0, "block_v must be positive, got ", block_v);
  check_cpu(logits, "logits");
  const int64_t N = logits.size(0), V = logits.size(1);
  const Head hd{1.f, 0.f, float(inv_t), false};
  Tensor out = at::empty_like(logits);
  const int64_t* tgt = target.data_ptr<int64_t>();
  const float* plse = lse.data_ptr<float>();
  const float* pent = ent.has_value() ? ent->data_ptr<float>() : nullptr;
  const float* pglp = g_lp.has_value() ? g_lp->data_ptr<float>() : nullptr;
  const float* pgent = g_ent.has_value() ? g_ent->data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "selective_log_softmax_bwd", [&] {
    const scalar_t* src = logits.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
      std::vector<float> row(std::min(V, block_v));
      for (int64_t i = r0; i < r1; ++i) {
        for (int64_t v0 = 0; v0 < V; v0 += block_v) {
          const int64_t c = std::min(V, v0 + block_v) - v0;
          const scalar_t* x = src + i * V + v0;
          for (int64_t j = 0; j < c; ++j) row[j] = static_cast<float>(x[j]);
          grad_row(row.data(), c, tgt[i] - v0, plse[i], pent ? pent[i] : 0.f, pglp ? pglp[i] : 0.f,
                   pgent ? pgent[i] : 0.f, hd);
          scalar_t* y = dst + i * V + v0;
          for (int64_t j = 0; j < c; ++j) y[j] = static_cast<scalar_t>(row[j]);
        }
      }
    });
  });
  return out;
}

TORCH_LIBRARY(grpo_mem, m) {
  m.def("linear_logprobs_fwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, float scale, float cap, "
        "float inv_t, bool has_cap, bool want_entropy, int block_n, int block_v) -> (Tensor, Tensor, Tensor)");
  m.def("linear_logprobs_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor lse, Tensor? ent, "
        "Tensor? g_lp, Tensor? g_ent, float scale, float cap, float inv_t, bool has_cap, bool need_dh, bool need_dw, "
        "bool need_db, int block_n, int block_v) -> (Tensor, Tensor, Tensor)");
  m.def("selective_log_softmax_fwd(Tensor logits, Tensor target, float inv_t, bool want_entropy, int block_v) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("selective_log_softmax_bwd(Tensor logits, Tensor target, Tensor lse, Tensor? ent, Tensor? g_lp, "
        "Tensor? g_ent, float inv_t, int block_v) -> Tensor");
}

TORCH_LIBRARY_IMPL(grpo_mem, CPU, m) {
  m.impl("linear_logprobs_fwd", &linear_logprobs_fwd);
  m.impl("linear_logprobs_bwd", &linear_logprobs_bwd);
  m.impl("selective_log_softmax_fwd", &selective_log_softmax_fwd);
  m.impl("selective_log_softmax_bwd", &selective_log_softmax_bwd);
}

// Importing grpo_mem._C registers the ops above; the module itself exposes nothing else.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.doc() = "grpo_mem C++ CPU kernels, registered as torch.ops.grpo_mem.* (see grpo_mem/ops/logprobs.py)";
}
