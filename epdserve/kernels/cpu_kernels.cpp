// Fused CPU kernels for the language model's step (loaded by epdserve/kernels/library.py).
//
// Each function does what several PyTorch calls did, with the same arithmetic and the same
// rounding points: values are computed in float32 and rounded to the tensor's dtype (float32 or
// bfloat16, round to nearest even) wherever the PyTorch version produced a tensor. Plain C ABI,
// called through ctypes with raw pointers: no PyTorch headers, so it builds in about a second.
// Strides are in elements. Built with -ffp-contract=off so that a*b+c is never fused into an FMA.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef uint16_t bf16;

inline float load(const float* p) { return *p; }
inline float load(const bf16* p) {
    uint32_t u = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void store(float* p, float v) { *p = v; }
// float -> bfloat16 bits, rounded to nearest even (a NaN stays a quiet NaN), as PyTorch does
inline uint32_t bf16_bits(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded;
}
inline void store(bf16* p, float v) { *p = static_cast<bf16>(bf16_bits(v)); }
// the value a tensor of type T would hold
inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const bf16*) {
    const uint32_t u = bf16_bits(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
template <typename T> inline float rnd(float v) { return round_to(v, static_cast<const T*>(nullptr)); }

// e^x within 2 ulp (Cody-Waite reduction and a degree-6 polynomial, as Cephes' expf), written so
// that the compiler vectorizes it: libm's expf is a scalar call, and a decode step takes one per
// attention score and per SwiGLU element.
inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

// x (rows of n, row stride sx) [+= delta (stride sd), rounded] ; out = w * round(rms_norm(x))
template <typename T>
void add_rms_norm(T* x, int64_t sx, const T* delta, int64_t sd, const T* w, T* out, int64_t so, int64_t rows,
                  int64_t n, float eps) {
    std::vector<float> row(n);
    for (int64_t r = 0; r < rows; ++r) {
        T* xr = x + r * sx;
        float ss = 0.f;
        if (delta != nullptr) {
            const T* dr = delta + r * sd;
            for (int64_t i = 0; i < n; ++i) {
                float v = rnd<T>(load(xr + i) + load(dr + i));
                store(xr + i, v);
                row[i] = v;
            }
        } else {
            for (int64_t i = 0; i < n; ++i) row[i] = load(xr + i);
        }
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) ss += row[i] * row[i];
        float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
        T* orow = out + r * so;
        for (int64_t i = 0; i < n; ++i) store(orow + i, load(w + i) * rnd<T>(row[i] * inv));
    }
}

// rotate heads [rows, heads, d] in place: x*cos + rotate_half(x)*sin, each product rounded
template <typename T>
void rope_rows(T* x, int64_t sx, int64_t heads, int64_t d, const T* cos, const T* sin, int64_t sc, int64_t rows) {
    const int64_t h2 = d / 2;
    std::vector<float> tmp(d);
    for (int64_t r = 0; r < rows; ++r) {
        const T* c = cos + r * sc;
        const T* s = sin + r * sc;
        for (int64_t h = 0; h < heads; ++h) {
            T* xh = x + r * sx + h * d;
            for (int64_t i = 0; i < d; ++i) tmp[i] = load(xh + i);
            for (int64_t i = 0; i < d; ++i) {
                float rot = i < h2 ? -tmp[i + h2] : tmp[i - h2];
                store(xh + i, rnd<T>(tmp[i] * load(c + i)) + rnd<T>(rot * load(s + i)));
            }
        }
    }
}

// k and v rows [rows, width] (row strides sk, sv) copied to cache slots (cache [slots, width])
template <typename T>
int write_kv(const T* k, int64_t sk, const T* v, int64_t sv, int64_t width, T* kc, T* vc, const int64_t* slots,
             int64_t rows, int64_t num_slots) {
    for (int64_t r = 0; r < rows; ++r)
        if (slots[r] < 0 || slots[r] >= num_slots) return -1;
    for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(kc + slots[r] * width, k + r * sk, width * sizeof(T));
        std::memcpy(vc + slots[r] * width, v + r * sv, width * sizeof(T));
    }
    return 0;
}

// out = round(silu(gate)) * up, rounded; gate and up are the two halves of each row of gu
template <typename T>
void silu_mul(const T* gu, int64_t sg, T* out, int64_t so, int64_t rows, int64_t n) {
    std::vector<float> e(n);
    for (int64_t r = 0; r < rows; ++r) {
        const T* g = gu + r * sg;
        const T* u = g + n;
        T* o = out + r * so;
        float* ep = e.data();
        for (int64_t i = 0; i < n; ++i) ep[i] = -load(g + i);
        for (int64_t i = 0; i < n; ++i) ep[i] = exp_approx(ep[i]);
        for (int64_t i = 0; i < n; ++i) store(o + i, rnd<T>(load(g + i) / (1.f + ep[i])) * load(u + i));
    }
}

// f(t, row of token t) for positions 0..n-1 of a sequence whose blocks are ``blocks``, in a cache
// whose tokens are ``row`` elements apart (``base`` points at the wanted head of token 0's slot)
template <typename T, typename F>
inline void each_token(const T* base, const int64_t* blocks, int64_t n, int64_t block_size, int64_t row, F f) {
    for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const T* block = base + blocks[t0 / block_size] * block_size * row;
        const int64_t len = n - t0 < block_size ? n - t0 : block_size;
        for (int64_t o = 0; o < len; ++o) f(t0 + o, block + o * row);
    }
}

// Attention of one new token per sequence over its paged context (the new token's k/v already in
// the cache): sequence b's query row q_rows[b] attends to positions 0..ctx[b]-1, whose slots come
// from block table row table_rows[b]. Query heads sharing a KV head (GQA) read its keys once.
// Scores, softmax and the weighted sum are float32 (fused multiply-adds, as SDPA's kernels).
template <typename T>
int decode_attention(const T* q, int64_t sq, const int64_t* q_rows, const T* kc, const T* vc, int64_t num_blocks,
                     const int64_t* table, int64_t st, int64_t table_len, const int64_t* table_rows, const int64_t* ctx,
                     int64_t batch, int64_t q_len, int64_t hq, int64_t hkv, int64_t d, int64_t block_size, float scale,
                     T* out, int64_t so) {
    // every index is checked before anything is read: a bad one is an error, never a stray read
    if (hkv < 1 || hq % hkv) return -1;
    for (int64_t b = 0; b < batch; ++b) {
        if (q_rows[b] < 0 || q_rows[b] >= q_len || table_rows[b] < 0 || table_rows[b] >= table_len) return -1;
        if (ctx[b] < 1 || ctx[b] > st * block_size) return -1;
        const int64_t* blocks = table + table_rows[b] * st;
        for (int64_t i = 0; i * block_size < ctx[b]; ++i)
            if (blocks[i] < 0 || blocks[i] >= num_blocks) return -1;
    }
    const int64_t group = hq / hkv;
    const int64_t row = hkv * d;  // elements per cached token
    std::vector<float> qf(group * d), acc(group * d), scores;
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t n = ctx[b];
        const int64_t* blocks = table + table_rows[b] * st;
        scores.resize(group * n);
        const T* qrow = q + q_rows[b] * sq;
        T* orow = out + q_rows[b] * so;
        for (int64_t g = 0; g < hkv; ++g) {
            for (int64_t j = 0; j < group * d; ++j) qf[j] = load(qrow + g * group * d + j);
            each_token(kc + g * d, blocks, n, block_size, row, [&](int64_t t, const T* kt) {
                for (int64_t j = 0; j < group; ++j) {
                    const float* qj = qf.data() + j * d;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t i = 0; i < d; ++i) s = std::fma(qj[i], load(kt + i), s);
                    scores[j * n + t] = s * scale;
                }
            });
            for (int64_t j = 0; j < group; ++j) {
                float* sj = scores.data() + j * n;
                float m = -INFINITY;
                for (int64_t t = 0; t < n; ++t) m = sj[t] > m ? sj[t] : m;
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < n; ++t) {
                    sj[t] = exp_approx(sj[t] - m);
                    sum += sj[t];
                }
                const float inv = 1.f / sum;
#pragma omp simd
                for (int64_t t = 0; t < n; ++t) sj[t] *= inv;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            each_token(vc + g * d, blocks, n, block_size, row, [&](int64_t t, const T* vt) {
                for (int64_t j = 0; j < group; ++j) {
                    const float p = scores[j * n + t];
                    float* aj = acc.data() + j * d;
#pragma omp simd
                    for (int64_t i = 0; i < d; ++i) aj[i] = std::fma(p, load(vt + i), aj[i]);
                }
            });
            for (int64_t j = 0; j < group * d; ++j) store(orow + g * group * d + j, acc[j]);
        }
    }
    return 0;
}

}  // namespace


extern "C" {

// dtype: 0 float32, 1 bfloat16. Every pointer is to the first element of a tensor (or view).

int epd_kernels_abi() { return 2; }

void epd_add_rms_norm(int dtype, void* x, int64_t sx, const void* delta, int64_t sd, const void* w, void* out,
                      int64_t so, int64_t rows, int64_t n, float eps) {
    if (dtype == 0)
        add_rms_norm((float*)x, sx, (const float*)delta, sd, (const float*)w, (float*)out, so, rows, n, eps);
    else
        add_rms_norm((bf16*)x, sx, (const bf16*)delta, sd, (const bf16*)w, (bf16*)out, so, rows, n, eps);
}

void epd_rotary(int dtype, void* x, int64_t sx, int64_t heads, int64_t d, const void* cos, const void* sin,
                int64_t sc, int64_t rows) {
    if (dtype == 0)
        rope_rows((float*)x, sx, heads, d, (const float*)cos, (const float*)sin, sc, rows);
    else
        rope_rows((bf16*)x, sx, heads, d, (const bf16*)cos, (const bf16*)sin, sc, rows);
}

void epd_silu_mul(int dtype, const void* gu, int64_t sg, void* out, int64_t so, int64_t rows, int64_t n) {
    if (dtype == 0)
        silu_mul((const float*)gu, sg, (float*)out, so, rows, n);
    else
        silu_mul((const bf16*)gu, sg, (bf16*)out, so, rows, n);
}

int epd_write_kv(int dtype, const void* k, int64_t sk, const void* v, int64_t sv, int64_t width, void* kc, void* vc,
                 const int64_t* slots, int64_t rows, int64_t num_slots) {
    if (dtype == 0)
        return write_kv((const float*)k, sk, (const float*)v, sv, width, (float*)kc, (float*)vc, slots, rows,
                        num_slots);
    return write_kv((const bf16*)k, sk, (const bf16*)v, sv, width, (bf16*)kc, (bf16*)vc, slots, rows, num_slots);
}

int epd_decode_attention(int dtype, const void* q, int64_t sq, const int64_t* q_rows, const void* kc, const void* vc,
                         int64_t num_blocks, const int64_t* table, int64_t st, int64_t table_len,
                         const int64_t* table_rows, const int64_t* ctx, int64_t batch, int64_t q_len, int64_t hq,
                         int64_t hkv, int64_t d, int64_t block_size, float scale, void* out, int64_t so) {
    if (dtype == 0)
        return decode_attention((const float*)q, sq, q_rows, (const float*)kc, (const float*)vc, num_blocks, table,
                                st, table_len, table_rows, ctx, batch, q_len, hq, hkv, d, block_size, scale,
                                (float*)out, so);
    return decode_attention((const bf16*)q, sq, q_rows, (const bf16*)kc, (const bf16*)vc, num_blocks, table, st,
                            table_len, table_rows, ctx, batch, q_len, hq, hkv, d, block_size, scale, (bf16*)out, so);
}

}  // extern "C"
