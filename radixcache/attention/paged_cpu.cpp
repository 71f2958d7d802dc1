// Paged attention on CPU that reads K/V where they lie in the pool (no gather into a contiguous
// context first). Built at run time by radixcache/attention/paged_cpu.py; see its docstring for the
// contract. One work item is (segment, KV head, a chunk of the segment's query tokens): its rows are
// those tokens times the query heads of the KV head (GQA), each with its own causal limit; the
// segment's blocks are visited once per item, each block's keys and values read from the pool
// while they are in cache, with an online softmax in float32 per row.
// ATen's vector types at the widest width this build's target has (-march=native)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
// ATen and the op registry only (not torch/extension.h and pybind11): a third of the build time
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kQueryChunk = 16;  // query tokens per work item

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const at::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float load(const at::Half* p, int64_t i) { return static_cast<float>(p[i]); }

inline float load(const double* p, int64_t i) { return static_cast<float>(p[i]); }

// n values of src as float32 into dst (bfloat16: its bits are a float32's upper half)
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const uint16_t* in = reinterpret_cast<const uint16_t*>(src);
    uint32_t* out = reinterpret_cast<uint32_t*>(dst);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(in[i]) << 16;
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = load(src, i);
  }
}

// a block's first n values as float32: the pool itself for float32, else widened into buffer
template <typename T>
inline const float* as_float(const T* src, std::vector<float>& buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    widen(src, buffer.data(), n);
    return buffer.data();
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  Vec sum(0.f);
  for (; i + Vec::size() <= n; i += Vec::size()) sum = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), sum);
  float total = sum.reduce_add();
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// scores[j] = q . keys[j] for the keys j in [lo, hi), each key `dim` floats apart
inline void dots(const float* q, const float* keys, int64_t dim, int64_t lo, int64_t hi, float* scores) {
  int64_t j = lo;
#if defined(CPU_CAPABILITY_AVX512)
  // 16 keys at a time: a vector of partial sums per key, then one transpose-reduce of the 16
  // vectors into the 16 scores (45 shuffles and adds instead of 16 horizontal sums)
  if (dim % 16 == 0) {
    for (; j + 16 <= hi; j += 16) {
      __m512 part[16];
      for (int k = 0; k < 16; ++k) part[k] = _mm512_setzero_ps();
      for (int64_t i = 0; i < dim; i += 16) {
        const __m512 qi = _mm512_loadu_ps(q + i);
        for (int k = 0; k < 16; ++k) part[k] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(keys + (j + k) * dim + i), part[k]);
      }
      __m512 pair[8], quad[4], half[2];
      for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
        pair[k] = _mm512_add_ps(_mm512_unpacklo_ps(part[2 * k], part[2 * k + 1]),
                                _mm512_unpackhi_ps(part[2 * k], part[2 * k + 1]));
      for (int k = 0; k < 4; ++k)  // per 128-bit lane: one partial sum of each of 4 keys
        quad[k] = _mm512_add_ps(_mm512_shuffle_ps(pair[2 * k], pair[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_ps(pair[2 * k], pair[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
      for (int k = 0; k < 2; ++k)  // 128-bit lanes added in pairs
        half[k] = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2 * k], quad[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(quad[2 * k], quad[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
      _mm512_storeu_ps(scores + j, _mm512_add_ps(_mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                                 _mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(3, 1, 3, 1))));
    }
  }
#endif
  for (; j < hi; ++j) scores[j] = dot(q, keys + j * dim, dim);
}

// y += sum over j in [lo, hi) of p[j] * values[j] (each value `n` floats apart), y held in
// registers across the keys; per element the same fused sums, in the same order, as one axpy per key
inline void weighted_sum(const float* p, const float* values, int64_t lo, int64_t hi, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    Vec acc = Vec::loadu(y + i);
    for (int64_t j = lo; j < hi; ++j) acc = at::vec::fmadd(Vec(p[j]), Vec::loadu(values + j * n + i), acc);
    acc.store(y + i);
  }
  for (; i < n; ++i) {
    float acc = y[i];
    for (int64_t j = lo; j < hi; ++j) acc += p[j] * values[j * n + i];
    y[i] = acc;
  }
}

inline void scale_in_place(float alpha, float* y, int64_t n) {
  int64_t i = 0;
  const Vec a(alpha);
  for (; i + Vec::size() <= n; i += Vec::size()) (a * Vec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] *= alpha;
}

// p[j] = exp(s[j] - peak) for j in [lo, hi); returns their sum
inline float exp_shifted(const float* s, float peak, float* p, int64_t lo, int64_t hi) {
  int64_t j = lo;
  const Vec shift(peak);
  Vec sum(0.f);
  for (; j + Vec::size() <= hi; j += Vec::size()) {
    Vec e = (Vec::loadu(s + j) - shift).exp_u20();
    e.store(p + j);
    sum = sum + e;
  }
  float total = sum.reduce_add();
  for (; j < hi; ++j) {
    p[j] = std::exp(s[j] - peak);
    total += p[j];
  }
  return total;
}

template <typename T>
void attend(const T* q, const T* k_pool, const T* v_pool, const int64_t* table, int64_t table_stride,
            const int64_t* seg_q_start, const int64_t* seg_q_len, const int64_t* seg_kv_len,
            const int64_t* seg_row, int64_t segments, T* out, int64_t heads, int64_t kv_heads,
            int64_t block_size, int64_t dim, int64_t dim_v, double scale, int64_t window, double softcap) {
  const int64_t groups = heads / kv_heads;
  // work items: (segment, kv head, query chunk), enumerated through a prefix sum of the chunks
  std::vector<int64_t> first_item(segments + 1, 0);
  for (int64_t s = 0; s < segments; ++s) {
    first_item[s + 1] = first_item[s] + kv_heads * ((seg_q_len[s] + kQueryChunk - 1) / kQueryChunk);
  }
  const int64_t items = first_item[segments];
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, peak, total, kf(block_size * dim), vf(block_size * dim_v);
    std::vector<float> score, prob;
    std::vector<int64_t> limit, lowest;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const int64_t local = item - first_item[s];
      const int64_t chunks = (seg_q_len[s] + kQueryChunk - 1) / kQueryChunk;
      const int64_t h = local / chunks, chunk = local % chunks;
      const int64_t t0 = chunk * kQueryChunk, t1 = std::min(seg_q_len[s], t0 + kQueryChunk);
      const int64_t rows = (t1 - t0) * groups, kv_len = seg_kv_len[s], past = kv_len - seg_q_len[s];
      qf.assign(rows * dim, 0.f);
      acc.assign(rows * dim_v, 0.f);
      peak.assign(rows, -std::numeric_limits<float>::infinity());
      total.assign(rows, 0.f);
      score.assign(rows * block_size, 0.f);
      prob.assign(rows * block_size, 0.f);
      limit.resize(rows);
      lowest.resize(rows);
      int64_t reach = 0, start = kv_len;
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r = (t - t0) * groups + g;
          const T* qrow = q + ((seg_q_start[s] + t) * heads + h * groups + g) * dim;
          for (int64_t i = 0; i < dim; ++i) qf[r * dim + i] = load(qrow, i) * static_cast<float>(scale);
          limit[r] = past + t + 1;  // keys 0 .. past + t are visible (causal)
          lowest[r] = window > 0 ? std::max<int64_t>(0, limit[r] - window) : 0;
          reach = std::max(reach, limit[r]);
          start = std::min(start, lowest[r]);
        }
      }
      const int64_t* blocks = table + seg_row[s] * table_stride;
      for (int64_t b = start / block_size; b * block_size < reach; ++b) {
        const int64_t base = b * block_size, block = blocks[b];
        const int64_t used = std::min(block_size, reach - base);  // never a slot past the context
        const float* keys = as_float(k_pool + (block * kv_heads + h) * block_size * dim, kf, used * dim);
        const float* values = as_float(v_pool + (block * kv_heads + h) * block_size * dim_v, vf, used * dim_v);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t lo = std::max<int64_t>(lowest[r] - base, 0);
          const int64_t hi = std::min<int64_t>(limit[r] - base, block_size);
          if (lo >= hi) continue;
          const float* qr = qf.data() + r * dim;
          float* sr = score.data() + r * block_size;
          float* pr = prob.data() + r * block_size;
          float block_peak = -std::numeric_limits<float>::infinity();
          dots(qr, keys, dim, lo, hi, sr);
          for (int64_t j = lo; j < hi; ++j) {
            if (softcap > 0) sr[j] = static_cast<float>(softcap) * std::tanh(sr[j] / static_cast<float>(softcap));
            block_peak = std::max(block_peak, sr[j]);
          }
          float* ar = acc.data() + r * dim_v;
          const float new_peak = std::max(peak[r], block_peak);
          if (peak[r] != new_peak && total[r] > 0.f) {
            const float rescale = std::exp(peak[r] - new_peak);
            scale_in_place(rescale, ar, dim_v);
            total[r] *= rescale;
          }
          peak[r] = new_peak;
          total[r] += exp_shifted(sr, new_peak, pr, lo, hi);
          weighted_sum(pr, values, lo, hi, ar, dim_v);
        }
      }
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r = (t - t0) * groups + g;
          T* o = out + ((seg_q_start[s] + t) * heads + h * groups + g) * dim_v;
          const float inv = total[r] > 0.f ? 1.f / total[r] : 0.f;
          for (int64_t i = 0; i < dim_v; ++i) o[i] = static_cast<T>(acc[r * dim_v + i] * inv);
        }
      }
    }
  });
}

}  // namespace

// query [T, H, D]; k_pool [N, Hkv, BS, D] and v_pool [N, Hkv, BS, Dv] (one layer); table [S, B]
// int64; segments [M, 4] int64 rows (q_start, q_len, kv_len, table row); -> out [T, H, Dv].
at::Tensor paged_attention(at::Tensor query, at::Tensor k_pool, at::Tensor v_pool, at::Tensor table,
                           at::Tensor segments, double scale, int64_t window, double softcap) {
  TORCH_CHECK(query.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && k_pool.dim() == 4 && v_pool.dim() == 4, "query [T, H, D], pools [N, Hkv, BS, D]");
  TORCH_CHECK(query.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type(),
              "query and pools must share a dtype");
  TORCH_CHECK(table.scalar_type() == at::kLong && segments.scalar_type() == at::kLong, "int64 table and segments");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "contiguous pools");
  auto q = query.contiguous();
  auto t = table.contiguous();
  auto seg = segments.contiguous();
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_pool.size(1), block_size = k_pool.size(2);
  const int64_t dim_v = v_pool.size(3);
  TORCH_CHECK(k_pool.size(3) == dim && heads % kv_heads == 0, "head dims and head counts must agree");
  auto out = at::empty({q.size(0), heads, dim_v}, q.options());
  const int64_t m = seg.size(0);
  std::vector<int64_t> q_start(m), q_len(m), kv_len(m), row(m);
  auto acc = seg.accessor<int64_t, 2>();
  for (int64_t i = 0; i < m; ++i) {
    q_start[i] = acc[i][0], q_len[i] = acc[i][1], kv_len[i] = acc[i][2], row[i] = acc[i][3];
    TORCH_CHECK(q_len[i] >= 1 && kv_len[i] >= q_len[i] && q_start[i] + q_len[i] <= q.size(0), "bad segment");
    TORCH_CHECK((kv_len[i] + block_size - 1) / block_size <= t.size(1), "a segment outgrows its table row");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(q.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(),
                     t.data_ptr<int64_t>(), t.size(1), q_start.data(), q_len.data(), kv_len.data(), row.data(), m,
                     out.data_ptr<scalar_t>(), heads, kv_heads, block_size, dim, dim_v, scale, window, softcap);
  });
  return out;
}

// torch.ops.radixcache_paged_cpu.paged_attention
TORCH_LIBRARY(radixcache_paged_cpu, m) {
  m.def("paged_attention(Tensor query, Tensor k_pool, Tensor v_pool, Tensor table, Tensor segments, float scale, "
        "int window, float softcap) -> Tensor");
}
TORCH_LIBRARY_IMPL(radixcache_paged_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
