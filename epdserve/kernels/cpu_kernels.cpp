// Fused CPU kernels for the language model's step (built and loaded by epdserve/kernels/build.py).
//
// Each function does what several PyTorch calls did, with the same arithmetic and the same
// rounding points: values are computed in float32 and rounded to the tensor's dtype (float32 or
// bfloat16, round to nearest even) wherever the PyTorch version produced a tensor. Plain C ABI,
// called through ctypes with raw pointers: no PyTorch headers, so it builds quickly.
// Strides are in elements. Built with -ffp-contract=off so that a*b+c is never fused into an FMA.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AMX_BF16__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Sixteen lanes at a time, the same arithmetic as the scalar helpers above, result for result:
// the compiler's vectorization of those loops leaves each exponential's dependent chain exposed,
// where these take several vectors' chains step by step

// the first ``n`` of 16 lanes
inline __mmask16 lanes(int64_t n) { return n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1u); }

inline __m512 load16(const bf16* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
// ``bf16_bits`` of each lane
inline __m512i bits16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}
// ``rnd<bf16>`` of each lane
inline __m512 round16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bits16(v), 16)); }
inline void store16(bf16* p, __mmask16 m, __m512 v) { _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bits16(v))); }
inline __m512 negate16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
}
// ``exp_approx`` of each lane of N vectors, operation for operation; each step taken for all N
// before the next, so that the CPU has N independent chains to overlap
template <int N>
inline void exp_approx16(__m512 (&x)[N]) {
    const auto mul = [](__m512 a, float b) { return _mm512_mul_ps(a, _mm512_set1_ps(b)); };
    const auto add = [](__m512 a, float b) { return _mm512_add_ps(a, _mm512_set1_ps(b)); };
    __m512 n[N], r[N], p[N];
    for (int k = 0; k < N; ++k) x[k] = _mm512_max_ps(_mm512_min_ps(x[k], _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
    for (int k = 0; k < N; ++k)
        n[k] = _mm512_roundscale_ps(add(mul(x[k], 1.44269504088896341f), 0.5f), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    for (int k = 0; k < N; ++k) r[k] = _mm512_add_ps(_mm512_sub_ps(x[k], mul(n[k], 0.693359375f)), mul(n[k], 2.12194440e-4f));
    for (int k = 0; k < N; ++k) p[k] = add(mul(r[k], 1.9875691500e-4f), 1.3981999507e-3f);
    for (int k = 0; k < N; ++k) p[k] = add(_mm512_mul_ps(p[k], r[k]), 8.3334519073e-3f);
    for (int k = 0; k < N; ++k) p[k] = add(_mm512_mul_ps(p[k], r[k]), 4.1665795894e-2f);
    for (int k = 0; k < N; ++k) p[k] = add(_mm512_mul_ps(p[k], r[k]), 1.6666665459e-1f);
    for (int k = 0; k < N; ++k) p[k] = add(_mm512_mul_ps(p[k], r[k]), 5.0000001201e-1f);
    for (int k = 0; k < N; ++k) p[k] = add(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p[k], r[k]), r[k]), r[k]), 1.f);
    for (int k = 0; k < N; ++k) {
        const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n[k]), _mm512_set1_epi32(127)), 23);
        x[k] = _mm512_mul_ps(p[k], _mm512_castsi512_ps(bits));
    }
}
#endif

// x (rows of n, row stride sx) [+= delta (stride sd), rounded] ; out = w * round(rms_norm(x))
// (each loop reads what the previous one wrote from x itself, not from a scratch row: the loads
// then never wait on a store the CPU cannot forward)
template <typename T>
void add_rms_norm(T* __restrict x, int64_t sx, const T* __restrict delta, int64_t sd, const T* __restrict w,
                  T* __restrict out, int64_t so, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        T* xr = x + r * sx;
        float ss = 0.f;
        if (delta != nullptr) {
            const T* dr = delta + r * sd;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; ++i) {
                const float v = rnd<T>(load(xr + i) + load(dr + i));
                store(xr + i, v);
                ss += v * v;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; ++i) ss += load(xr + i) * load(xr + i);
        }
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
        T* orow = out + r * so;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) store(orow + i, load(w + i) * rnd<T>(load(xr + i) * inv));
    }
}

// rotate heads [rows, heads, d] in place: x*cos + rotate_half(x)*sin. RoundEach: each product
// rounded to T, as a language model rotating in T does; else in float32 (by float32 angles, A) and
// rounded to T once at the end, as a vision tower does (in bfloat16 the angles of far patches
// would be lost). Element i and i + d/2 of a head depend only on each other: one pass rewrites both.
template <bool RoundEach, typename T, typename A>
void rope_rows(T* __restrict x, int64_t sx, int64_t heads, int64_t d, const A* __restrict cos,
               const A* __restrict sin, int64_t sc, int64_t rows) {
    const int64_t h2 = d / 2;
    for (int64_t r = 0; r < rows; ++r) {
        const A* c = cos + r * sc;
        const A* s = sin + r * sc;
        for (int64_t h = 0; h < heads; ++h) {
            T* xh = x + r * sx + h * d;
            // first half: x*cos - x2*sin; second half: x*cos + x1*sin (rotate_half)
#pragma omp simd
            for (int64_t i = 0; i < h2; ++i) {
                const float lo = load(xh + i), hi = load(xh + h2 + i);
                const float a = lo * load(c + i), b = -hi * load(s + i);
                const float e = hi * load(c + h2 + i), f = lo * load(s + h2 + i);
                if constexpr (RoundEach) {
                    store(xh + i, rnd<T>(a) + rnd<T>(b));
                    store(xh + h2 + i, rnd<T>(e) + rnd<T>(f));
                } else {
                    store(xh + i, a + b);
                    store(xh + h2 + i, e + f);
                }
            }
        }
    }
}

bool slots_valid(const int64_t* slots, int64_t rows, int64_t num_slots) {
    for (int64_t r = 0; r < rows; ++r)
        if (slots[r] < 0 || slots[r] >= num_slots) return false;
    return true;
}

// k and v rows [rows, width] (row strides sk, sv) copied to cache slots (cache [slots, width]);
// the slots must be valid (slots_valid)
template <typename T>
void copy_kv(const T* k, int64_t sk, const T* v, int64_t sv, int64_t width, T* kc, T* vc, const int64_t* slots,
             int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(kc + slots[r] * width, k + r * sk, width * sizeof(T));
        std::memcpy(vc + slots[r] * width, v + r * sv, width * sizeof(T));
    }
}

// copy_kv after every slot was checked: -1 (nothing written) for one out of range
template <typename T>
int write_kv(const T* k, int64_t sk, const T* v, int64_t sv, int64_t width, T* kc, T* vc, const int64_t* slots,
             int64_t rows, int64_t num_slots) {
    if (!slots_valid(slots, rows, num_slots)) return -1;
    copy_kv(k, sk, v, sv, width, kc, vc, slots, rows);
    return 0;
}

// out = round(silu(gate)) * up, rounded; gate and up are the two halves of each row of gu
template <typename T>
void silu_mul(const T* __restrict gu, int64_t sg, T* __restrict out, int64_t so, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) {
        const T* g = gu + r * sg;
        const T* u = g + n;
        T* o = out + r * so;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            const float gi = load(g + i);
            store(o + i, rnd<T>(gi / (1.f + exp_approx(-gi))) * load(u + i));
        }
    }
}

// out = x * sigmoid(1.702 x) (quick GELU), rounded where PyTorch rounds: the scaled input, the
// sigmoid, the product
template <typename T>
void quick_gelu(const T* __restrict x, T* __restrict out, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const float xi = load(x + i);
        const float a = rnd<T>(xi * 1.702f);
        store(out + i, xi * rnd<T>(1.f / (1.f + exp_approx(-a))));
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// ``silu_mul`` of N vectors of a row from ``i`` (the last one's lanes ``m``)
template <int N>
inline void silu_mul16(const bf16* g, const bf16* u, bf16* o, int64_t i, __mmask16 m) {
    __m512 gi[N], e[N];
    __mmask16 mk[N];
    for (int k = 0; k < N; ++k) mk[k] = k == N - 1 ? m : 0xffff;
    for (int k = 0; k < N; ++k) gi[k] = load16(g + i + 16 * k, mk[k]);
    for (int k = 0; k < N; ++k) e[k] = negate16(gi[k]);
    exp_approx16<N>(e);
    for (int k = 0; k < N; ++k) {
        const __m512 silu = _mm512_div_ps(gi[k], _mm512_add_ps(_mm512_set1_ps(1.f), e[k]));
        store16(o + i + 16 * k, mk[k], _mm512_mul_ps(round16(silu), load16(u + i + 16 * k, mk[k])));
    }
}

template <>
void silu_mul(const bf16* __restrict gu, int64_t sg, bf16* __restrict out, int64_t so, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) {
        const bf16* g = gu + r * sg;
        int64_t i = 0;
        for (; i + 64 <= n; i += 64) silu_mul16<4>(g, g + n, out + r * so, i, 0xffff);
        for (; i < n; i += 16) silu_mul16<1>(g, g + n, out + r * so, i, lanes(n - i));
    }
}

// ``quick_gelu`` of N vectors from ``i`` (the last one's lanes ``m``)
template <int N>
inline void quick_gelu16(const bf16* x, bf16* out, int64_t i, __mmask16 m) {
    __m512 xi[N], e[N];
    __mmask16 mk[N];
    for (int k = 0; k < N; ++k) mk[k] = k == N - 1 ? m : 0xffff;
    for (int k = 0; k < N; ++k) xi[k] = load16(x + i + 16 * k, mk[k]);
    for (int k = 0; k < N; ++k) e[k] = negate16(round16(_mm512_mul_ps(xi[k], _mm512_set1_ps(1.702f))));
    exp_approx16<N>(e);
    for (int k = 0; k < N; ++k) {
        const __m512 sigmoid = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e[k]));
        store16(out + i + 16 * k, mk[k], _mm512_mul_ps(xi[k], round16(sigmoid)));
    }
}

template <>
void quick_gelu(const bf16* __restrict x, bf16* __restrict out, int64_t n) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) quick_gelu16<4>(x, out, i, 0xffff);
    for (; i < n; i += 16) quick_gelu16<1>(x, out, i, lanes(n - i));
}
#endif

// Eight lanes of float32 in GCC's vector extension: the compiler maps them to the machine's own
// SIMD registers (AVX2, AVX-512, NEON), with no intrinsics to port.
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
    v8f r;
    std::memcpy(&r, p, sizeof r);
    return r;
}
inline v8f load8(const bf16* p) {
    v8h h;
    std::memcpy(&h, p, sizeof h);
    const v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f r;
    std::memcpy(&r, &u, sizeof r);
    return r;
}
inline float hsum(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// Attention sums may use fused multiply-adds, as SDPA's own kernels do (the elementwise kernels
// above keep PyTorch's separate roundings).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

// f(t) for the positions t = 0..n-1 of a sequence, ``tok`` holding token t's row (nv vectors) of
// the cache at ``base`` (the wanted head of slot 0; tokens ``row`` elements apart)
template <typename T, typename F>
__attribute__((always_inline)) inline void each_row(const T* base, const int64_t* blocks, int64_t n,
                                                    int64_t block_size, int64_t row, int64_t nv, v8f* tok, F&& f) {
    for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const T* block = base + blocks[t0 / block_size] * block_size * row;
        const int64_t len = n - t0 < block_size ? n - t0 : block_size;
        for (int64_t o = 0; o < len; ++o) {
            const T* r = block + o * row;
            for (int64_t v = 0; v < nv; ++v) tok[v] = load8(r + 8 * v);
            f(t0 + o);
        }
    }
}

// One sequence's query heads of one KV head (``group`` of them, ``qrow`` [group, d]) over its
// ``n`` cached tokens. NV = head_dim / 8 when it is known at compile time (the common head sizes:
// the loops over a row unroll and a token's row stays in registers), 0 for any other size.
template <int NV, typename T>
void attend(const T* qrow, const T* kbase, const T* vbase, const int64_t* blocks, int64_t n, int64_t block_size,
            int64_t row, int64_t group, int64_t dyn_nv, float scale, float* scores, v8f* qv, v8f* acc, v8f* tokbuf,
            T* orow) {
    const int64_t nv = NV ? NV : dyn_nv;
    v8f local[NV ? NV : 1];
    v8f* tok = NV ? local : tokbuf;
    for (int64_t j = 0; j < group * nv; ++j) qv[j] = load8(qrow + 8 * j);
    each_row(kbase, blocks, n, block_size, row, nv, tok, [&](int64_t t) __attribute__((always_inline)) {
        for (int64_t j = 0; j < group; ++j) {
            v8f s = qv[j * nv] * tok[0];
            for (int64_t v = 1; v < nv; ++v) s += qv[j * nv + v] * tok[v];
            scores[j * n + t] = hsum(s) * scale;
        }
    });
    for (int64_t j = 0; j < group; ++j) {
        float* sj = scores + j * n;
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
    for (int64_t j = 0; j < group * nv; ++j) acc[j] = v8f{};
    each_row(vbase, blocks, n, block_size, row, nv, tok, [&](int64_t t) __attribute__((always_inline)) {
        for (int64_t j = 0; j < group; ++j) {
            const float p = scores[j * n + t];
            for (int64_t v = 0; v < nv; ++v) acc[j * nv + v] += p * tok[v];
        }
    });
    for (int64_t j = 0; j < group * nv; ++j)
        for (int64_t i = 0; i < 8; ++i) store(orow + 8 * j + i, acc[j][i]);
}

// Whether every query row, block-table row, context length and block id of an attention call is
// in range (what decode_attention reads through them)
bool attention_rows_valid(const int64_t* q_rows, const int64_t* table, int64_t st, int64_t table_len,
                          const int64_t* table_rows, const int64_t* ctx, int64_t batch, int64_t q_len,
                          int64_t num_blocks, int64_t block_size) {
    for (int64_t b = 0; b < batch; ++b) {
        if (q_rows[b] < 0 || q_rows[b] >= q_len || table_rows[b] < 0 || table_rows[b] >= table_len) return false;
        if (ctx[b] < 1 || ctx[b] > st * block_size) return false;
        const int64_t* blocks = table + table_rows[b] * st;
        for (int64_t i = 0; i * block_size < ctx[b]; ++i)
            if (blocks[i] < 0 || blocks[i] >= num_blocks) return false;
    }
    return true;
}

// Attention of one new token per sequence over its paged context (the new token's k/v already in
// the cache): sequence b's query row q_rows[b] attends to positions 0..ctx[b]-1, whose slots come
// from block table row table_rows[b]. Query heads sharing a KV head (GQA) read its keys once.
// Scores, softmax and the weighted sum are float32. The indices must be valid
// (attention_rows_valid), hkv >= 1 must divide hq and head_dim be a multiple of 8.
template <typename T>
void attend_rows(const T* q, int64_t sq, const int64_t* q_rows, const T* kc, const T* vc, const int64_t* table,
                 int64_t st, const int64_t* table_rows, const int64_t* ctx, int64_t batch, int64_t hq, int64_t hkv,
                 int64_t d, int64_t block_size, float scale, T* out, int64_t so) {
    const int64_t group = hq / hkv, nv = d / 8;
    const int64_t row = hkv * d;  // elements per cached token
    std::vector<v8f> qv(group * nv), acc(group * nv), tok(nv);
    std::vector<float> scores;
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t n = ctx[b];
        const int64_t* blocks = table + table_rows[b] * st;
        scores.resize(group * n);
        for (int64_t g = 0; g < hkv; ++g) {
            const T* qrow = q + q_rows[b] * sq + g * group * d;
            T* orow = out + q_rows[b] * so + g * group * d;
            const T *kb = kc + g * d, *vb = vc + g * d;
            float* sc = scores.data();
            if (nv == 8)
                attend<8>(qrow, kb, vb, blocks, n, block_size, row, group, nv, scale, sc, qv.data(), acc.data(), tok.data(), orow);
            else if (nv == 16)
                attend<16>(qrow, kb, vb, blocks, n, block_size, row, group, nv, scale, sc, qv.data(), acc.data(), tok.data(), orow);
            else
                attend<0>(qrow, kb, vb, blocks, n, block_size, row, group, nv, scale, sc, qv.data(), acc.data(), tok.data(), orow);
        }
    }
}

// attend_rows after every index was checked: a bad one is an error, never a stray read
template <typename T>
int decode_attention(const T* q, int64_t sq, const int64_t* q_rows, const T* kc, const T* vc, int64_t num_blocks,
                     const int64_t* table, int64_t st, int64_t table_len, const int64_t* table_rows, const int64_t* ctx,
                     int64_t batch, int64_t q_len, int64_t hq, int64_t hkv, int64_t d, int64_t block_size, float scale,
                     T* out, int64_t so) {
    if (hkv < 1 || hq % hkv || d % 8) return -1;
    if (!attention_rows_valid(q_rows, table, st, table_len, table_rows, ctx, batch, q_len, num_blocks, block_size))
        return -1;
    attend_rows(q, sq, q_rows, kc, vc, table, st, table_rows, ctx, batch, hq, hkv, d, block_size, scale, out, so);
    return 0;
}

#pragma GCC pop_options

// ---- image resampling: Pillow's bicubic resize of 8-bit images, bit for bit ----------------
// Pillow resizes in two passes, horizontal then vertical, each rounding to 8 bits: an output
// sample is a weighted sum of up to ksize input samples, the weights (the bicubic filter with
// a = -0.5, stretched by the scale when shrinking) computed in double, normalized to sum 1 and
// turned into fixed point with 22 fraction bits. Doing the same integer arithmetic gives the same
// bytes; the speed comes from summing eight rows (or eight outputs) per vector instruction.

constexpr int kFracBits = 22;

inline double bicubic(double x) {
    const double a = -0.5;
    if (x < 0.0) x = -x;
    if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
}

struct Taps {
    int64_t ksize = 0;
    std::vector<int32_t> first, count, weight;  // per output: first input, inputs used, ksize weights
};

Taps bicubic_taps(int64_t in_size, int64_t out_size) {
    Taps t;
    const double scale = static_cast<double>(in_size) / static_cast<double>(out_size);
    const double filterscale = scale < 1.0 ? 1.0 : scale;
    const double support = 2.0 * filterscale;
    t.ksize = static_cast<int64_t>(std::ceil(support)) * 2 + 1;
    t.first.resize(out_size);
    t.count.resize(out_size);
    t.weight.assign(out_size * t.ksize, 0);
    std::vector<double> w(t.ksize);
    for (int64_t o = 0; o < out_size; ++o) {
        const double center = (o + 0.5) * scale, ss = 1.0 / filterscale;
        int64_t lo = static_cast<int64_t>(center - support + 0.5), hi = static_cast<int64_t>(center + support + 0.5);
        if (lo < 0) lo = 0;
        if (hi > in_size) hi = in_size;
        const int64_t n = hi - lo;
        double sum = 0.0;
        for (int64_t i = 0; i < n; ++i) {
            w[i] = bicubic((static_cast<double>(i + lo) - center + 0.5) * ss);
            sum += w[i];
        }
        for (int64_t i = 0; i < n; ++i) {
            const double k = sum != 0.0 ? w[i] / sum : w[i];
            t.weight[o * t.ksize + i] = static_cast<int32_t>(k < 0 ? -0.5 + k * (1 << kFracBits) : 0.5 + k * (1 << kFracBits));
        }
        t.first[o] = static_cast<int32_t>(lo);
        t.count[o] = static_cast<int32_t>(n);
    }
    return t;
}

inline uint8_t clip8(int32_t acc) {
    const int32_t v = acc >> kFracBits;
    return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v8b __attribute__((vector_size(8)));

// eight bytes at p as eight int32 lanes (one instruction where the machine has one)
inline v8i widen8(const uint64_t* p) {
#ifdef __AVX2__
    v8i r;
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    std::memcpy(&r, &w, sizeof r);
    return r;
#else
    v8b b;
    std::memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, v8i);
#endif
}

// the 8 x 8 bytes of r (byte j of r[i] is row i, column j) transposed in place (byte i of r[j])
inline void transpose8x8(uint64_t* r) {
    for (int i = 0; i < 8; i += 2) {  // swap the off-diagonal bytes of each 2 x 2 block
        const uint64_t t = ((r[i] >> 8) ^ r[i + 1]) & 0x00FF00FF00FF00FFull;
        r[i + 1] ^= t;
        r[i] ^= t << 8;
    }
    for (int i = 0; i < 8; i += 4)  // then of each 2 x 2 block of byte pairs
        for (int k = 0; k < 2; ++k) {
            const uint64_t t = ((r[i + k] >> 16) ^ r[i + k + 2]) & 0x0000FFFF0000FFFFull;
            r[i + k + 2] ^= t;
            r[i + k] ^= t << 16;
        }
    for (int k = 0; k < 4; ++k) {  // then of the 2 x 2 block of 4-byte quarters
        const uint64_t t = ((r[k] >> 32) ^ r[k + 4]) & 0x00000000FFFFFFFFull;
        r[k + 4] ^= t;
        r[k] ^= t << 32;
    }
}

// rows [y0, y1) of ``in`` (h x w x c) resampled horizontally to ow columns, into ``out`` (rows
// from 0, ow x c each): eight rows at a time, transposed so that each input column's eight
// samples are one vector
void resample_rows(const uint8_t* in, int64_t w, int64_t c, int64_t y0, int64_t y1, const Taps& t, int64_t ow,
                   uint8_t* out) {
    const int64_t width = w * c, words = (width + 7) / 8;
    std::vector<uint64_t> col(words * 8);  // col[j]: byte j of each of the eight rows
    for (int64_t y = y0; y < y1; y += 8) {
        const int64_t rows = y1 - y < 8 ? y1 - y : 8;
        for (int64_t b = 0; b < words; ++b) {
            uint64_t blk[8] = {};
            if (8 * b + 8 <= width && rows == 8) {  // the common case: whole words, loaded as such
                for (int64_t r = 0; r < 8; ++r) std::memcpy(&blk[r], in + (y + r) * width + 8 * b, 8);
            } else {
                const int64_t n = width - 8 * b < 8 ? width - 8 * b : 8;
                for (int64_t r = 0; r < rows; ++r) std::memcpy(&blk[r], in + (y + r) * width + 8 * b, n);
            }
            transpose8x8(blk);
            std::memcpy(&col[8 * b], blk, sizeof blk);
        }
        for (int64_t o = 0; o < ow; ++o) {
            const int32_t* k = t.weight.data() + o * t.ksize;
            const int64_t lo = t.first[o], n = t.count[o];
            for (int64_t ch = 0; ch < c; ++ch) {
                v8i acc = v8i{} + (1 << (kFracBits - 1));
                for (int64_t i = 0; i < n; ++i) acc += widen8(&col[(lo + i) * c + ch]) * k[i];
                for (int64_t r = 0; r < rows; ++r) out[((y - y0) + r) * ow * c + o * c + ch] = clip8(acc[r]);
            }
        }
    }
}

// every row of ``in`` (rows x width bytes) resampled vertically to oh rows (width bytes each)
void resample_columns(const uint8_t* in, int64_t width, int64_t oh, const Taps& t, uint8_t* out) {
    std::vector<int32_t> acc(width);
    for (int64_t o = 0; o < oh; ++o) {
        const int32_t* k = t.weight.data() + o * t.ksize;
        for (int64_t j = 0; j < width; ++j) acc[j] = 1 << (kFracBits - 1);
        for (int64_t i = 0; i < t.count[o]; ++i) {
            const uint8_t* row = in + (t.first[o] + i) * width;
            const int32_t ki = k[i];
            for (int64_t j = 0; j < width; ++j) acc[j] += row[j] * ki;
        }
        for (int64_t j = 0; j < width; ++j) out[o * width + j] = clip8(acc[j]);
    }
}

// ---- bfloat16 matmul on AMX tiles, for the few rows of a decode or short prefill step --------
// oneDNN's own AMX kernels are the right tool for many rows; for a few dozen rows its per-call
// cost, most of it outside the matrix product, is most of the time. The weight [N, K] is
// packed once into the tile layout (``amx_pack``): for each 16 output columns and each 32 of K,
// one 1 KB tile whose row r holds, per column, the pair (k0 + 2r, k0 + 2r + 1). A step's rows go
// through in blocks of 16 against four column tiles at a time, summed in float32, then the bias
// (in float32) and one rounding to bfloat16 - what oneDNN does, summed in its own order.

// The pointers of one layer in a decoder stack's table (int64 each), in this order.
enum LayerPtr { LP_IN_NORM, LP_QKV, LP_QKV_BIAS, LP_O, LP_POST_NORM, LP_GATE_UP, LP_DOWN, LP_K_CACHE, LP_V_CACHE, LP_COUNT };

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

bool amx_permitted() {
    static const bool ok = [] {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return ok;
}

void amx_configure() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {  // 0-3: float32 sums 16 x 16; 4: 16 rows x 32 of K; 5: a weight tile
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

void amx_linear(const bf16* x, int64_t sx, int64_t m, int64_t k, const bf16* wp, int64_t n, const bf16* bias,
                bf16* out, int64_t so) {
    const int64_t kb = (k + 31) / 32, nb = (n + 15) / 16;
    const bool ragged = k % 32 != 0;
    const int64_t whole = m / 16 * 16;  // rows read in place, in whole 16-row blocks
    // copied, zero-padded: the last K block of the whole blocks when K is ragged, and the rows
    // past the last whole block (the tiles never read past a row or past the input)
    std::vector<bf16> last_k(ragged ? whole * 32 : 0, 0), last_rows(m > whole ? 16 * kb * 32 : 0, 0);
    for (int64_t r = 0; ragged && r < whole; ++r)
        std::memcpy(&last_k[r * 32], x + r * sx + (kb - 1) * 32, (k - (kb - 1) * 32) * 2);
    for (int64_t r = whole; r < m; ++r) std::memcpy(&last_rows[(r - whole) * kb * 32], x + r * sx, k * 2);
    alignas(64) float acc[4][16 * 16];
    amx_configure();
    // four column tiles at a time against every row block: their weight tiles stay in L1
    for (int64_t n0 = 0; n0 < nb; n0 += 4) {
        const int64_t tiles = nb - n0 < 4 ? nb - n0 : 4;
        const bf16* w = wp + n0 * kb * 512;
        for (int64_t m0 = 0; m0 < m; m0 += 16) {
            const int64_t mr = m - m0 < 16 ? m - m0 : 16;
            const bool inside = m0 < whole;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k0 = 0; k0 < kb; ++k0) {
                if (!inside)
                    _tile_loadd(4, last_rows.data() + k0 * 32, kb * 32 * 2);
                else if (ragged && k0 == kb - 1)
                    _tile_loadd(4, last_k.data() + m0 * 32, 64);
                else
                    _tile_loadd(4, x + m0 * sx + k0 * 32, sx * 2);
                _tile_loadd(5, w + k0 * 512, 64);
                _tile_dpbf16ps(0, 4, 5);
                if (tiles > 1) {
                    _tile_loadd(5, w + (kb + k0) * 512, 64);
                    _tile_dpbf16ps(1, 4, 5);
                }
                if (tiles > 2) {
                    _tile_loadd(5, w + (2 * kb + k0) * 512, 64);
                    _tile_dpbf16ps(2, 4, 5);
                }
                if (tiles > 3) {
                    _tile_loadd(5, w + (3 * kb + k0) * 512, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            _tile_stored(0, acc[0], 64);
            _tile_stored(1, acc[1], 64);
            _tile_stored(2, acc[2], 64);
            _tile_stored(3, acc[3], 64);
            for (int64_t t = 0; t < tiles; ++t) {
                const int64_t c0 = (n0 + t) * 16, cols = n - c0 < 16 ? n - c0 : 16;
                const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
                const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + c0)), 16))
                                      : _mm512_setzero_ps();
                for (int64_t r = 0; r < mr; ++r) {  // + bias, then one rounding to bfloat16 (as oneDNN)
                    const __m512 v = _mm512_add_ps(_mm512_load_ps(acc[t] + r * 16), b);
                    _mm256_mask_storeu_epi16(out + (m0 + r) * so + c0, keep, (__m256i)_mm512_cvtneps_pbh(v));
                }
            }
        }
    }
    _tile_release();
}

#endif

// ``work(a, b)`` for spans of ``align``-unit groups of n units on up to ``threads`` threads of the
// OpenMP runtime the process already runs (torch's, which the library shares when built by GCC):
// torch's own threads would otherwise spin on the cores a second pool needs.
template <typename F>
void split_spans(int64_t n, int64_t align, int64_t threads, F&& work) {
    const int64_t groups = (n + align - 1) / align;
    const int parts = static_cast<int>(threads < groups ? threads : groups);
    auto span = [&](int t) {
        const int64_t a = groups * t / parts * align, b0 = groups * (t + 1) / parts * align, b = b0 < n ? b0 : n;
        if (a < b) work(a, b);
    };
    if (parts == 1) {
        span(0);
        return;
    }
#if defined(_OPENMP)
#pragma omp parallel num_threads(parts)
    span(omp_get_thread_num());
#else
    for (int t = 0; t < parts; ++t) span(t);
#endif
}

// ``cols(a, b)`` for spans of 64-column groups of n output columns (``split_spans``): a column's
// sums do not depend on the split
template <typename F>
void split_columns(int64_t n, int64_t threads, F&& cols) {
    split_spans(n, 64, threads, cols);
}

// The matmuls of a decoder layer, in the order the stack's ``linear`` is told which one it runs.
enum StackMatmul { SM_QKV, SM_O, SM_GATE_UP, SM_DOWN, SM_COUNT };

// Every layer of a Qwen2-style decoder over the rows of one step whose tokens all attend row by
// row over the paged cache (row r's query attends over ctx[r] positions of block-table row
// table_rows[r]): the calls the Python layer makes, in its order and with its rounding points, in
// one call (bit for bit the same outputs). ``linear(which, x, sx, m, k, w, n, bias, out, so)`` is
// the tile engine's product by the weight ``w`` of the layer's matmul ``which`` (StackMatmul);
// ``before_layer(l)`` runs before layer l. x [rows, hidden] is the residual stream, updated in
// place; out [rows, hidden] gets the final norm of it. -1 for an index out of range.
template <typename Linear, typename Before>
int decoder_stack(Linear&& linear, Before&& before_layer, const int64_t* ptrs, int64_t layers, int64_t hidden,
                  int64_t hq, int64_t hkv, int64_t d, int64_t inter, float eps, float scale, bf16* x, int64_t rows,
                  const bf16* final_norm, bf16* out, const bf16* cos, const bf16* sin, const int64_t* slots,
                  int64_t num_blocks, int64_t block_size, const int64_t* table, int64_t st, int64_t table_len,
                  const int64_t* table_rows, const int64_t* ctx) {
    const int64_t qkvw = (hq + 2 * hkv) * d, qw = hq * d;
    std::vector<int64_t> q_rows(rows);
    for (int64_t r = 0; r < rows; ++r) q_rows[r] = r;
    // every index checked once, before any layer runs: a bad step changes nothing, in no layer
    if (!slots_valid(slots, rows, num_blocks * block_size) ||
        !attention_rows_valid(q_rows.data(), table, st, table_len, table_rows, ctx, rows, rows, num_blocks, block_size))
        return -1;
    std::vector<bf16> h(rows * hidden), qkv(rows * qkvw), attn(rows * qw), gu(rows * 2 * inter), act(rows * inter),
        delta(rows * hidden);
    const auto at = [](int64_t v) { return reinterpret_cast<bf16*>(static_cast<intptr_t>(v)); };
    for (int64_t l = 0; l < layers; ++l) {
        before_layer(l);
        const int64_t* p = ptrs + l * LP_COUNT;
        bf16 *kc = at(p[LP_K_CACHE]), *vc = at(p[LP_V_CACHE]);
        add_rms_norm(x, hidden, l ? delta.data() : nullptr, hidden, at(p[LP_IN_NORM]), h.data(), hidden, rows, hidden,
                     eps);
        linear(SM_QKV, h.data(), hidden, rows, hidden, at(p[LP_QKV]), qkvw, at(p[LP_QKV_BIAS]), qkv.data(), qkvw);
        rope_rows<true>(qkv.data(), qkvw, hq + hkv, d, cos, sin, d, rows);
        copy_kv(qkv.data() + qw, qkvw, qkv.data() + qw + hkv * d, qkvw, hkv * d, kc, vc, slots, rows);
        attend_rows(qkv.data(), qkvw, q_rows.data(), kc, vc, table, st, table_rows, ctx, rows, hq, hkv, d, block_size,
                    scale, attn.data(), qw);
        linear(SM_O, attn.data(), qw, rows, qw, at(p[LP_O]), hidden, nullptr, delta.data(), hidden);
        add_rms_norm(x, hidden, delta.data(), hidden, at(p[LP_POST_NORM]), h.data(), hidden, rows, hidden, eps);
        linear(SM_GATE_UP, h.data(), hidden, rows, hidden, at(p[LP_GATE_UP]), 2 * inter, nullptr, gu.data(), 2 * inter);
        silu_mul(gu.data(), 2 * inter, act.data(), inter, rows, inter);
        linear(SM_DOWN, act.data(), inter, rows, inter, at(p[LP_DOWN]), hidden, nullptr, delta.data(), hidden);
    }
    add_rms_norm(x, hidden, layers ? delta.data() : nullptr, hidden, final_norm, out, hidden, rows, hidden, eps);
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__)
// The tile layout of ``epd_amx_pack`` read by AVX2 float32 multiply-adds, for CPUs with neither
// AMX nor AVX-512 bfloat16 (AVX2 only, or AVX-512 without bfloat16). In a block of 16 output
// columns, input pair p is two 32-byte halves of 8 columns x 2 inputs; a bfloat16 is the top half
// of its float32, so a shift gives each column's even input and a mask its odd one, exactly. x
// is widened to float32 once per chunk of rows. The product of two bfloat16 values is exact in
// float32, so the sums are of the same products as the other engines'; a row's sums run in one
// order (input by input) whatever rows share its pass, the bias is added in float32 and the
// result rounded once. Up to 4 rows per pass: 8 sums, 4 widened weights and 2 broadcasts fill
// AVX2's 16 vector registers.
constexpr int FMA_ROWS = 4;                      // rows of x per pass over a column block
constexpr int64_t FMA_CHUNK_FLOATS = 1 << 20;    // float32 x widened at a time (4 MiB)
constexpr int64_t FMA_AHEAD = 64;                // pairs (64-byte lines) of weight fetched ahead

// one row's sums of the low and high 8 columns
struct FmaSums {
    __m256 lo, hi;
};

__attribute__((always_inline)) inline void fma_row(FmaSums& s, const float* x, __m256 lo_e, __m256 lo_o,
                                                   __m256 hi_e, __m256 hi_o) {
    const __m256 xe = _mm256_broadcast_ss(x), xo = _mm256_broadcast_ss(x + 1);
    s.lo = _mm256_fmadd_ps(xe, lo_e, s.lo);
    s.hi = _mm256_fmadd_ps(xe, hi_e, s.hi);
    s.lo = _mm256_fmadd_ps(xo, lo_o, s.lo);
    s.hi = _mm256_fmadd_ps(xo, hi_o, s.hi);
}

inline void fma_store(const FmaSums& s, const bf16* bias, bf16* out, int64_t cols) {
    alignas(32) float sums[16];
    _mm256_store_ps(sums, s.lo);
    _mm256_store_ps(sums + 8, s.hi);
    for (int64_t c = 0; c < cols; ++c) store(out + c, bias ? sums[c] + load(bias + c) : sums[c]);
}

// R rows of float32 x (row stride k2) against one column block. The sums are named values, not
// an array: GCC keeps an array of vectors in memory, storing it on every pass of the loop.
template <int R>
void fma_tile(const float* xf, int64_t k2, const bf16* w, const bf16* bias, bf16* out, int64_t so, int64_t cols) {
    static_assert(R >= 1 && R <= FMA_ROWS, "rows per pass");
    const __m256 zero = _mm256_setzero_ps();
    FmaSums s0{zero, zero}, s1 = s0, s2 = s0, s3 = s0;
    const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const int64_t pairs = k2 / 2;
    for (int64_t p = 0; p < pairs; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (p + FMA_AHEAD) * 32), _MM_HINT_T0);
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32 + 16));
        const __m256 lo_e = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
        const __m256 lo_o = _mm256_castsi256_ps(_mm256_and_si256(lo, odd));
        const __m256 hi_e = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
        const __m256 hi_o = _mm256_castsi256_ps(_mm256_and_si256(hi, odd));
        fma_row(s0, xf + 2 * p, lo_e, lo_o, hi_e, hi_o);
        if constexpr (R >= 2) fma_row(s1, xf + k2 + 2 * p, lo_e, lo_o, hi_e, hi_o);
        if constexpr (R >= 3) fma_row(s2, xf + 2 * k2 + 2 * p, lo_e, lo_o, hi_e, hi_o);
        if constexpr (R >= 4) fma_row(s3, xf + 3 * k2 + 2 * p, lo_e, lo_o, hi_e, hi_o);
    }
    fma_store(s0, bias, out, cols);
    if constexpr (R >= 2) fma_store(s1, bias, out + so, cols);
    if constexpr (R >= 3) fma_store(s2, bias, out + 2 * so, cols);
    if constexpr (R >= 4) fma_store(s3, bias, out + 3 * so, cols);
}

// columns [a, b) (a a multiple of 16) of ``rows`` rows of float32 x (row stride k2, even)
void fma_columns(const float* xf, int64_t k2, int64_t rows, const bf16* wp, int64_t kb, int64_t a, int64_t b,
                 const bf16* bias, bf16* out, int64_t so) {
    for (int64_t c = a; c < b; c += 16) {
        const bf16* w = wp + c / 16 * kb * 512;
        const bf16* bb = bias ? bias + c : nullptr;
        const int64_t cols = b - c < 16 ? b - c : 16;
        for (int64_t r = 0; r < rows; r += FMA_ROWS) {
            const float* x = xf + r * k2;
            bf16* o = out + r * so + c;
            switch (rows - r) {
                case 1: fma_tile<1>(x, k2, w, bb, o, so, cols); break;
                case 2: fma_tile<2>(x, k2, w, bb, o, so, cols); break;
                case 3: fma_tile<3>(x, k2, w, bb, o, so, cols); break;
                default: fma_tile<4>(x, k2, w, bb, o, so, cols);
            }
        }
    }
}

// out [m, n] = x [m, k] . w^T (+ bias), w in the tile layout, on up to ``threads`` threads
// (``split_columns``), row chunks of x widened to float32 once each
void fma_linear(const bf16* x, int64_t sx, int64_t m, int64_t k, const bf16* wp, int64_t n, const bf16* bias,
                bf16* out, int64_t so, int64_t threads) {
    const int64_t kb = (k + 31) / 32, k2 = (k + 1) / 2 * 2;
    int64_t chunk = FMA_CHUNK_FLOATS / k2 / FMA_ROWS * FMA_ROWS;
    if (chunk < FMA_ROWS) chunk = FMA_ROWS;
    std::vector<float> xf((m < chunk ? m : chunk) * k2, 0.0f);
    for (int64_t r0 = 0; r0 < m; r0 += chunk) {
        const int64_t rows = m - r0 < chunk ? m - r0 : chunk;
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < k; ++j) xf[r * k2 + j] = load(x + (r0 + r) * sx + j);
        split_columns(n, threads, [&](int64_t a, int64_t b) {
            fma_columns(xf.data(), k2, rows, wp, kb, a, b, bias, out + r0 * so, so);
        });
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// float32 rows of x against a float32 weight as loaded (row-major [n, k]), for the few rows of a
// decode step, where a BLAS's matrix-vector paths read the weight well under the memory's speed
// and barely faster on a second thread: each output is a dot product over one contiguous weight
// row, which stays in cache while every pair of x rows passes over it, so a call reads the weight
// once, front to back. A row's sum runs in one order (four 8-lane partial sums over 32-input
// steps, added in a fixed order, then the remaining inputs one by one; the bias last), whatever
// rows share its pass and however the columns are split. The hardware's prefetch follows the
// weight's one stream, which a software prefetch in the same row only slowed; but with more than
// two rows the later passes over a column read it from cache and the stream stalls, so the
// second pass fetches the row ROW_AHEAD columns on into L2.
constexpr int64_t ROW_AHEAD = 4;  // weight rows ahead that the second pass over a column fetches
inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// one row's partial sums; named values, not an array (see fma_tile)
struct RowSums {
    __m256 a, b, c, d;
};

__attribute__((always_inline)) inline void row_step(RowSums& s, const float* x, __m256 w0, __m256 w1, __m256 w2,
                                                    __m256 w3) {
    s.a = _mm256_fmadd_ps(_mm256_loadu_ps(x), w0, s.a);
    s.b = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w1, s.b);
    s.c = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), w2, s.c);
    s.d = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), w3, s.d);
}

inline float row_total(const RowSums& s, const float* x, const float* w, int64_t i, int64_t k, const float* bias) {
    float t = sum8(_mm256_add_ps(_mm256_add_ps(s.a, s.b), _mm256_add_ps(s.c, s.d)));
    for (; i < k; ++i) t += x[i] * w[i];
    return bias ? t + *bias : t;
}

// R (1 or 2) rows of x (row stride sx) against weight row w: out[0] and out[so]; the weight row
// ``ahead`` (or none) fetched into L2 on the way
template <int R>
void row_dot(const float* x, int64_t sx, int64_t k, const float* w, const float* bias, float* out, int64_t so,
             const float* ahead) {
    const __m256 zero = _mm256_setzero_ps();
    RowSums s0{zero, zero, zero, zero}, s1 = s0;
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        if (ahead) {
            _mm_prefetch(reinterpret_cast<const char*>(ahead + i), _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(ahead + i + 16), _MM_HINT_T1);
        }
        const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        const __m256 w2 = _mm256_loadu_ps(w + i + 16), w3 = _mm256_loadu_ps(w + i + 24);
        row_step(s0, x + i, w0, w1, w2, w3);
        if constexpr (R == 2) row_step(s1, x + sx + i, w0, w1, w2, w3);
    }
    out[0] = row_total(s0, x, w, i, k, bias);
    if constexpr (R == 2) out[so] = row_total(s1, x + sx, w, i, k, bias);
}

// output columns [a, b) of ``m`` rows
void row_columns(const float* x, int64_t sx, int64_t m, int64_t k, const float* w, int64_t a, int64_t b,
                 const float* bias, float* out, int64_t so) {
    for (int64_t c = a; c < b; ++c) {
        const float* wc = w + c * k;
        const float* bc = bias ? bias + c : nullptr;
        const float* next = c + ROW_AHEAD < b ? wc + ROW_AHEAD * k : nullptr;
        for (int64_t r = 0; r < m; r += 2) {
            const float* ahead = r == 2 ? next : nullptr;  // the second pass
            if (m - r >= 2)
                row_dot<2>(x + r * sx, sx, k, wc, bc, out + r * so + c, so, ahead);
            else
                row_dot<1>(x + r * sx, sx, k, wc, bc, out + r * so + c, so, ahead);
        }
    }
}
#endif

#if defined(__AVX512BF16__)
// The tile layout of ``epd_amx_pack`` read by AVX-512 bfloat16 dot products, for CPUs without
// AMX: in a block of 16 output columns, input pair p holds 16 columns x 2 inputs (64 bytes), so
// one load and a broadcast pair of x make 16 float32 sums. R rows of x against B blocks, the
// weight read once for all R rows; the bias added in float32, one rounding (as amx_linear).

// one input pair of R rows (``xp[r]``: its two bfloat16 values) into the sums of B column blocks
template <int R, int B>
inline void dot_pair(__m512 (&acc)[R][B], const bf16* w, int64_t kb, int64_t p, const uint32_t (&xp)[R]) {
    __m512bh wv[B];
    for (int b = 0; b < B; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w + b * kb * 512 + p * 32);
    for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r]));
        for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xb, wv[b]);
    }
}

// Up to DOT_STREAM_ROWS rows the loop is short enough for the hardware's prefetchers to keep the
// weight streaming from memory; with more rows of dot products a pair, each column block's weight
// is fetched DOT_AHEAD pairs (64-byte lines) ahead.
constexpr int DOT_STREAM_ROWS = 4;
constexpr int64_t DOT_AHEAD = 64;

template <int R, int B>
void dot_tile(const bf16* x, int64_t sx, int64_t k, const bf16* w, int64_t kb, const bf16* bias, bf16* out,
              int64_t so, int64_t cols) {
    __m512 acc[R][B];
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
    uint32_t xp[R];
    const int64_t pairs = k / 2;
    for (int64_t p = 0; p < pairs; ++p) {
        if constexpr (R > DOT_STREAM_ROWS)
            for (int b = 0; b < B; ++b)
                _mm_prefetch(reinterpret_cast<const char*>(w + b * kb * 512 + (p + DOT_AHEAD) * 32), _MM_HINT_T0);
        for (int r = 0; r < R; ++r) std::memcpy(&xp[r], x + r * sx + 2 * p, 4);
        dot_pair<R, B>(acc, w, kb, p, xp);
    }
    if (k % 2) {  // a half pair: the weight's other half is the layout's zero padding
        for (int r = 0; r < R; ++r) xp[r] = x[r * sx + k - 1];
        dot_pair<R, B>(acc, w, kb, pairs, xp);
    }
    for (int b = 0; b < B; ++b) {
        const int64_t left = cols - b * 16;
        const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1u);
        __m512 bv = _mm512_setzero_ps();
        if (bias)
            bv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + b * 16)), 16));
        for (int r = 0; r < R; ++r) {
            const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][b], bv));
            _mm256_mask_storeu_epi16(out + r * so + b * 16, mask, (__m256i)v);
        }
    }
}

template <int B>
void dot_rows(int64_t rows, const bf16* x, int64_t sx, int64_t k, const bf16* w, int64_t kb, const bf16* bias,
              bf16* out, int64_t so, int64_t cols) {
    switch (rows) {
        case 1: dot_tile<1, B>(x, sx, k, w, kb, bias, out, so, cols); break;
        case 2: dot_tile<2, B>(x, sx, k, w, kb, bias, out, so, cols); break;
        case 3: dot_tile<3, B>(x, sx, k, w, kb, bias, out, so, cols); break;
        case 4: dot_tile<4, B>(x, sx, k, w, kb, bias, out, so, cols); break;
        case 5: dot_tile<5, B>(x, sx, k, w, kb, bias, out, so, cols); break;
        case 6: dot_tile<6, B>(x, sx, k, w, kb, bias, out, so, cols); break;
        case 7: dot_tile<7, B>(x, sx, k, w, kb, bias, out, so, cols); break;
        default: dot_tile<8, B>(x, sx, k, w, kb, bias, out, so, cols);
    }
}

// out [m, n] (row stride so) = x [m, k] (row stride sx) . w^T (+ bias), w in the tile layout:
// two column blocks at a time against every group of up to 8 rows (the blocks stay in cache)
void dot_linear(const bf16* x, int64_t sx, int64_t m, int64_t k, const bf16* wp, int64_t n, const bf16* bias,
                bf16* out, int64_t so) {
    const int64_t kb = (k + 31) / 32, nb = (n + 15) / 16;
    for (int64_t b0 = 0; b0 < nb; b0 += 2) {
        const bf16* w = wp + b0 * kb * 512;
        const bf16* bb = bias ? bias + b0 * 16 : nullptr;
        const int64_t cols = n - b0 * 16 < 32 ? n - b0 * 16 : 32;
        for (int64_t r = 0; r < m; r += 8) {
            const int64_t rows = m - r < 8 ? m - r : 8;
            if (nb - b0 >= 2)
                dot_rows<2>(rows, x + r * sx, sx, k, w, kb, bb, out + r * so + b0 * 16, so, cols);
            else
                dot_rows<1>(rows, x + r * sx, sx, k, w, kb, bb, out + r * so + b0 * 16, so, cols);
        }
    }
}

// dot_linear on up to ``threads`` threads (``split_columns``): a column's sums do not depend on it
void dot_linear_split(const bf16* x, int64_t sx, int64_t m, int64_t k, const bf16* wp, int64_t n, const bf16* bias,
                      bf16* out, int64_t so, int64_t threads) {
    const int64_t kb = (k + 31) / 32;
    split_columns(n, threads, [&](int64_t a, int64_t b) {
        dot_linear(x, sx, m, k, wp + a / 16 * kb * 512, b - a, bias ? bias + a : nullptr, out + a, so);
    });
}
#endif


#if defined(__AVX512BF16__)
// Attention by AVX-512 bfloat16 dot products (CPUs with AVX-512 bfloat16): per (frame, query
// head), the scores of R query rows against 16 keys at a time from keys packed as
// [nk/16][d/2][16 keys x 2], summed in float32; softmax in float32 over the keys a row sees (all
// nk, or a causal prefix); the weights rounded to bfloat16 and multiplied into values packed as
// [nk/2][d][2 keys] unnormalized, summed in float32, divided by the sum of the rounded weights
// and rounded once. SDPA's arithmetic on the CPU (bfloat16 products summed in float32, the
// weights rounded for the second product); the order of the sums differs.

// e^x on 16 lanes for the softmax (x <= 0 there): ``exp_approx``'s reduction and polynomial by
// fused multiply-adds, the power of two applied by scalef (to zero far below). Not
// ``exp_approx16``, which keeps the scalar code's roundings for the activations; the softmax has
// no scalar twin to match and takes the shorter chain
inline __m512 exp16(__m512 x) {
    const auto fma = [](__m512 a, __m512 b, float c) { return _mm512_fmadd_ps(a, b, _mm512_set1_ps(c)); };
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = fma(_mm512_set1_ps(1.9875691500e-4f), r, 1.3981999507e-3f);
    p = fma(p, r, 8.3334519073e-3f);
    p = fma(p, r, 4.1665795894e-2f);
    p = fma(p, r, 1.6666665459e-1f);
    p = fma(p, r, 5.0000001201e-1f);
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

// the scaled scores of R query rows (``q[r]``) against KB blocks of 16 packed keys, into ``s``
// (row stride ``stride``): R x KB independent sums, enough to cover the dot product's latency
template <int R, int KB>
inline void score_blocks(const bf16* const* q, const bf16* kj, int64_t pairs, float* s, int64_t stride,
                         float scale) {
    __m512 acc[R][KB];
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < KB; ++b) acc[r][b] = _mm512_setzero_ps();
    for (int64_t t = 0; t < pairs; ++t) {
        __m512bh kv[KB];
        for (int b = 0; b < KB; ++b) kv[b] = (__m512bh)_mm512_loadu_si512(kj + (b * pairs + t) * 32);
        for (int r = 0; r < R; ++r) {
            uint32_t qp;
            std::memcpy(&qp, q[r] + 2 * t, 4);
            const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp));
            for (int b = 0; b < KB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], qb, kv[b]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < KB; ++b) _mm512_storeu_ps(s + r * stride + b * 16, _mm512_mul_ps(acc[r][b], _mm512_set1_ps(scale)));
}

// ``rows`` (up to R) query rows; row r sees the first ``seen + r`` keys (``causal``) or all nk
template <int R, int DB>
void attend_rows(const bf16* q, int64_t sq, int64_t rows, const bf16* kp, const bf16* vp, bf16* out, int64_t so,
                 int64_t nk, int64_t seen, bool causal, float scale, float* s, uint32_t* pp) {
    constexpr int64_t d = DB * 16, pairs = d / 2;
    const int64_t stride = (nk + 15) / 16 * 16, np = (nk + 1) / 2;
    int64_t len[R];
    const bf16* qr[R];
    for (int r = 0; r < R; ++r) {
        const int64_t row = r < rows ? r : rows - 1;  // a group's missing rows repeat its last (never used)
        const int64_t l = causal ? seen + row : nk;
        len[r] = l < nk ? l : nk;
        qr[r] = q + row * sq;
    }
    const int64_t most = len[R - 1], blocks = (most + 15) / 16, used = (most + 1) / 2;
    constexpr int KB = 16 / R;
    int64_t kb = 0;
    for (; kb + KB <= blocks; kb += KB) score_blocks<R, KB>(qr, kp + kb * pairs * 32, pairs, s + kb * 16, stride, scale);
    for (; kb < blocks; ++kb) score_blocks<R, 1>(qr, kp + kb * pairs * 32, pairs, s + kb * 16, stride, scale);
    float inv[R];
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = len[r];
        float* sr = s + r * stride;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 mask = lanes(n - j);
            mv = _mm512_mask_max_ps(mv, mask, mv, _mm512_maskz_loadu_ps(mask, sr + j));
        }
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        // the weights as rounded for the product, and their own sum: they add up to one
        bf16* pr = reinterpret_cast<bf16*>(pp + r * np);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 mask = lanes(n - j);
            const __m256bh w = _mm512_cvtneps_pbh(exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sr + j), m)));
            _mm256_mask_storeu_epi16(pr + j, mask, (__m256i)w);
            const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)w), 16));
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, rounded));
        }
        for (int64_t j = n; j < 2 * used; ++j) pr[j] = 0;  // keys this row does not see
        inv[r] = 1.f / _mm512_reduce_add_ps(sum);
    }
    // the values a pass of CB column blocks at a time: R x CB sums in registers, every value read
    // once for the R rows
    constexpr int CB = DB > 5 ? DB / 2 : DB;
    for (int c0 = 0; c0 < DB; c0 += CB) {
        __m512 o[R][CB];
        for (int r = 0; r < R; ++r)
            for (int b = 0; b < CB; ++b) o[r][b] = _mm512_setzero_ps();
        for (int64_t t = 0; t < used; ++t) {
            __m512bh vv[CB];
            for (int b = 0; b < CB; ++b) vv[b] = (__m512bh)_mm512_loadu_si512(vp + t * d * 2 + (c0 + b) * 32);
            for (int r = 0; r < R; ++r) {
                const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r * np + t]));
                for (int b = 0; b < CB; ++b) o[r][b] = _mm512_dpbf16_ps(o[r][b], pb, vv[b]);
            }
        }
        for (int64_t r = 0; r < rows; ++r)
            for (int b = 0; b < CB; ++b)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * so + (c0 + b) * 16),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[r][b], _mm512_set1_ps(inv[r]))));
    }
}

// one (frame, KV head)'s nk keys and values, rows of a head's d columns at row strides sk, sv,
// packed for ``attend_rows``: keys [nk/16][d/2][16 keys x 2], values [nk/2][d][2 keys], the keys
// past nk zero
void pack_kv(const bf16* k, int64_t sk, const bf16* v, int64_t sv, int64_t nk, int64_t d, bf16* kp, bf16* vp) {
    const int64_t pairs = d / 2, nb = (nk + 15) / 16, np = (nk + 1) / 2;
    uint32_t* kw = reinterpret_cast<uint32_t*>(kp);
    for (int64_t jb = 0; jb < nb; ++jb)
        for (int64_t i = 0; i < 16; ++i) {
            const int64_t j = jb * 16 + i;
            uint32_t* col = kw + jb * pairs * 16 + i;
            if (j < nk) {
                const bf16* row = k + j * sk;
                for (int64_t t = 0; t < pairs; ++t) std::memcpy(col + t * 16, row + 2 * t, 4);
            } else {
                for (int64_t t = 0; t < pairs; ++t) col[t * 16] = 0;
            }
        }
    for (int64_t t = 0; t < np; ++t) {
        const bf16* v0 = v + 2 * t * sv;
        const bf16* v1 = 2 * t + 1 < nk ? v0 + sv : nullptr;
        bf16* o = vp + t * d * 2;
        for (int64_t c = 0; c < d; ++c) {
            o[2 * c] = v0[c];
            o[2 * c + 1] = v1 ? v1[c] : 0;
        }
    }
}

// units [u0, u1) of (frame, query head) = (u / heads, u % heads): nq query and out rows per frame
// (row strides sq, so; a head's d columns at h * d), nk key and value rows per frame (row
// strides sk, sv), query head h reading KV head h / (heads / kv_heads), packed here once for the
// run of units that read it; with ``causal``, query row i sees the first nk - nq + i + 1 keys
template <int DB>
void attend_units(const bf16* q, int64_t sq, const bf16* k, int64_t sk, const bf16* v, int64_t sv, bf16* out,
                  int64_t so, int64_t nq, int64_t nk, int64_t heads, int64_t kv_heads, bool causal, int64_t u0,
                  int64_t u1, float scale) {
    constexpr int64_t d = DB * 16;
    constexpr int R = 4;
    const int64_t nb = (nk + 15) / 16, np = (nk + 1) / 2, group = heads / kv_heads;
    std::vector<float> s(R * nb * 16);
    std::vector<uint32_t> pp(R * np);
    std::vector<bf16> kp(nb * 16 * d), vp(np * 2 * d);
    int64_t packed = -1;
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t f = u / heads, h = u % heads, hk = h / group, kvu = f * kv_heads + hk;
        if (kvu != packed) {
            pack_kv(k + f * nk * sk + hk * d, sk, v + f * nk * sv + hk * d, sv, nk, d, kp.data(), vp.data());
            packed = kvu;
        }
        const bf16* qu = q + f * nq * sq + h * d;
        bf16* ou = out + f * nq * so + h * d;
        for (int64_t i = 0; i < nq; i += R) {
            const int64_t rows = nq - i < R ? nq - i : R;
            attend_rows<R, DB>(qu + i * sq, sq, rows, kp.data(), vp.data(), ou + i * so, so, nk, nk - nq + i + 1,
                               causal, scale, s.data(), pp.data());
        }
    }
}
#endif

}  // namespace


extern "C" {

// dtype: 0 float32, 1 bfloat16. Every pointer is to the first element of a tensor (or view).

// The version of these exports' signatures and of the decoder stack's layer table: bumped with
// any change to either. kernels/build.py holds the one Python copy of both numbers and refuses a
// library whose answers differ (KernelBuildError), before any call.
int epd_kernels_abi() { return 18; }
int epd_layer_pointers() { return LP_COUNT; }

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
        rope_rows<true>((float*)x, sx, heads, d, (const float*)cos, (const float*)sin, sc, rows);
    else
        rope_rows<true>((bf16*)x, sx, heads, d, (const bf16*)cos, (const bf16*)sin, sc, rows);
}

void epd_rotary_f32(int dtype, void* x, int64_t sx, int64_t heads, int64_t d, const float* cos, const float* sin,
                    int64_t sc, int64_t rows) {
    if (dtype == 0)
        rope_rows<false>((float*)x, sx, heads, d, cos, sin, sc, rows);
    else
        rope_rows<false>((bf16*)x, sx, heads, d, cos, sin, sc, rows);
}

// (these two split their elements or rows over ``threads`` of the process's OpenMP threads, torch's
// own: a second pool would contend with them for the cores while they wait for work)
void epd_quick_gelu(int dtype, const void* x, void* out, int64_t n, int64_t threads) {
    split_spans(n, 64, threads < 1 ? 1 : threads, [&](int64_t a, int64_t b) {
        if (dtype == 0)
            quick_gelu((const float*)x + a, (float*)out + a, b - a);
        else
            quick_gelu((const bf16*)x + a, (bf16*)out + a, b - a);
    });
}

void epd_silu_mul(int dtype, const void* gu, int64_t sg, void* out, int64_t so, int64_t rows, int64_t n,
                  int64_t threads) {
    split_spans(rows, 1, threads < 1 ? 1 : threads, [&](int64_t a, int64_t b) {
        if (dtype == 0)
            silu_mul((const float*)gu + a * sg, sg, (float*)out + a * so, so, b - a, n);
        else
            silu_mul((const bf16*)gu + a * sg, sg, (bf16*)out + a * so, so, b - a, n);
    });
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

// Whether the AMX matmul runs here: built for a CPU with AMX and the kernel lets this process use
// its tile registers.
int epd_amx_available() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    return amx_permitted() ? 1 : 0;
#else
    return 0;
#endif
}

// w [n, k] bfloat16 packed into ``out`` in the tile layout: ceil(n / 16) * ceil(k / 32) tiles of 512
void epd_amx_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* out) {
    const int64_t kb = (k + 31) / 32, nb = (n + 15) / 16;
    for (int64_t b = 0; b < nb; ++b)
        for (int64_t k0 = 0; k0 < kb; ++k0) {
            uint16_t* tile = out + (b * kb + k0) * 512;
            for (int64_t r = 0; r < 16; ++r)
                for (int64_t c = 0; c < 16; ++c)
                    for (int64_t e = 0; e < 2; ++e) {
                        const int64_t col = b * 16 + c, kk = k0 * 32 + 2 * r + e;
                        tile[r * 32 + c * 2 + e] = col < n && kk < k ? w[col * k + kk] : 0;
                    }
        }
}

// out [m, n] (row stride so) = x [m, k] (row stride sx) . w^T (+ bias), bfloat16; -1 without AMX
int epd_amx_linear(const uint16_t* x, int64_t sx, int64_t m, int64_t k, const uint16_t* wp, int64_t n,
                   const uint16_t* bias, uint16_t* out, int64_t so) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (!amx_permitted() || m < 1 || k < 1 || n < 1 || sx < k || so < n) return -1;
    amx_linear(x, sx, m, k, wp, n, bias, out, so);
    return 0;
#else
    (void)x, (void)sx, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)out, (void)so;
    return -1;
#endif
}

// The same product on the same layout by AVX-512 bfloat16 dot products (CPUs without AMX); -1
// where the CPU has neither
int epd_dot_available() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

// On up to ``threads`` threads (``split_columns``).
int epd_dot_linear(const uint16_t* x, int64_t sx, int64_t m, int64_t k, const uint16_t* wp, int64_t n,
                   const uint16_t* bias, uint16_t* out, int64_t so, int64_t threads) {
#if defined(__AVX512BF16__)
    if (m < 1 || k < 1 || n < 1 || sx < k || so < n || threads < 1) return -1;
    dot_linear_split(x, sx, m, k, wp, n, bias, out, so, threads);
    return 0;
#else
    (void)x, (void)sx, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)out, (void)so, (void)threads;
    return -1;
#endif
}

// Attention within each of ``frames`` frames: nq query rows of ``heads`` heads against nk keys
// and values of ``kv_heads`` heads, d (64, 80 or 128) columns a head, every key or (``causal``)
// a causal prefix (``attend_units``), on up to ``threads`` threads; -1 without AVX-512 bfloat16
// or for sizes refused
int epd_frame_attention(const uint16_t* q, int64_t sq, const uint16_t* k, int64_t sk, const uint16_t* v,
                        int64_t sv, uint16_t* out, int64_t so, int64_t frames, int64_t nq, int64_t nk, int64_t heads,
                        int64_t kv_heads, int64_t d, float scale, int causal, int64_t threads) {
#if defined(__AVX512BF16__)
    if (frames < 1 || nq < 1 || nk < 1 || heads < 1 || kv_heads < 1 || heads % kv_heads || threads < 1) return -1;
    if (sq < heads * d || so < heads * d || sk < kv_heads * d || sv < kv_heads * d || (causal && nk < nq)) return -1;
    if (d != 64 && d != 80 && d != 128) return -1;
    split_spans(frames * heads, 1, threads, [&](int64_t a, int64_t b) {
        if (d == 64) attend_units<4>(q, sq, k, sk, v, sv, out, so, nq, nk, heads, kv_heads, causal, a, b, scale);
        if (d == 80) attend_units<5>(q, sq, k, sk, v, sv, out, so, nq, nk, heads, kv_heads, causal, a, b, scale);
        if (d == 128) attend_units<8>(q, sq, k, sk, v, sv, out, so, nq, nk, heads, kv_heads, causal, a, b, scale);
    });
    return 0;
#else
    (void)q, (void)sq, (void)k, (void)sk, (void)v, (void)sv, (void)out, (void)so, (void)frames, (void)nq, (void)nk;
    (void)heads, (void)kv_heads, (void)d, (void)scale, (void)causal, (void)threads;
    return -1;
#endif
}

// The same product on the same layout by AVX2 float32 multiply-adds (CPUs with neither AMX nor
// AVX-512 bfloat16); -1 where the CPU lacks AVX2 and FMA
int epd_fma_available() {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

// As ``epd_dot_linear``, on up to ``threads`` threads (``split_columns``), row chunks of x widened
// to float32 once each
int epd_fma_linear(const uint16_t* x, int64_t sx, int64_t m, int64_t k, const uint16_t* wp, int64_t n,
                   const uint16_t* bias, uint16_t* out, int64_t so, int64_t threads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (m < 1 || k < 1 || n < 1 || sx < k || so < n || threads < 1) return -1;
    fma_linear(x, sx, m, k, wp, n, bias, out, so, threads);
    return 0;
#else
    (void)x, (void)sx, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)out, (void)so, (void)threads;
    return -1;
#endif
}

// float32 out [m, n] (row stride so) = x [m, k] (row stride sx) . w^T (+ bias), w [n, k] as loaded
// (``row_columns``), on up to ``threads`` threads (``split_columns``); -1 without AVX2 and FMA or
// for sizes refused
int epd_row_linear_f32(const float* x, int64_t sx, int64_t m, int64_t k, const float* w, int64_t n,
                       const float* bias, float* out, int64_t so, int64_t threads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (m < 1 || k < 1 || n < 1 || sx < k || so < n || threads < 1) return -1;
    split_columns(n, threads, [&](int64_t a, int64_t b) { row_columns(x, sx, m, k, w, a, b, bias, out, so); });
    return 0;
#else
    (void)x, (void)sx, (void)m, (void)k, (void)w, (void)n, (void)bias, (void)out, (void)so, (void)threads;
    return -1;
#endif
}

// All layers of a decoder stack in one call (``decoder_stack``, bfloat16): ``ptrs`` holds
// LP_COUNT pointers per layer, its weights in the tile layout, read by ``engine`` (0: AMX, 1:
// AVX-512 bfloat16 dot products, 2: AVX2 multiply-adds), each of a layer's matmuls on
// ``threads[which]`` threads (SM_COUNT of them; AMX takes one). Threads on cores lent by other
// processes are handed back between layers: ``lenders`` holds the addresses of ``n_lenders``
// int32 flags in shared memory (a lender's "computing"); once one reads nonzero before a layer,
// that layer and the rest run on ``own_threads[which]``. 0, or 1 where the cores were handed back;
// -1 where that engine does not run here, for sizes refused, or an index out of range.
int epd_decoder_stack(int engine, const int64_t* threads, const int64_t* own_threads, const int64_t* lenders,
                      int64_t n_lenders, const int64_t* ptrs, int64_t layers, int64_t hidden, int64_t hq, int64_t hkv,
                      int64_t d, int64_t inter, float eps, float scale, uint16_t* x, int64_t rows,
                      const uint16_t* final_norm, uint16_t* out, const uint16_t* cos, const uint16_t* sin,
                      const int64_t* slots, int64_t num_blocks, int64_t block_size, const int64_t* table, int64_t st,
                      int64_t table_len, const int64_t* table_rows, const int64_t* ctx) {
    if (layers < 0 || rows < 1 || hidden < 1 || inter < 1 || hkv < 1 || hq % hkv || d % 8) return -1;
    if (n_lenders < 0 || (n_lenders > 0 && (lenders == nullptr || own_threads == nullptr))) return -1;
    for (int i = 0; i < SM_COUNT; ++i)
        if (threads[i] < 1 || (own_threads != nullptr && own_threads[i] < 1)) return -1;
    const int64_t* cur = threads;  // the thread counts the matmuls run on now
    const auto before_layer = [&](int64_t) {
        if (cur == own_threads) return;
        for (int64_t i = 0; i < n_lenders; ++i) {
            const auto* flag = reinterpret_cast<const int32_t*>(static_cast<intptr_t>(lenders[i]));
            if (__atomic_load_n(flag, __ATOMIC_ACQUIRE)) {
                cur = own_threads;
                return;
            }
        }
    };
    const auto stack = [&](auto&& linear) {
        const int status = decoder_stack(linear, before_layer, ptrs, layers, hidden, hq, hkv, d, inter, eps, scale, x,
                                         rows, final_norm, out, cos, sin, slots, num_blocks, block_size, table, st,
                                         table_len, table_rows, ctx);
        return status < 0 ? status : cur == own_threads && own_threads != threads ? 1 : 0;
    };
    switch (engine) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
        case 0:
            if (!amx_permitted()) return -1;
            return stack([](int, const bf16* a, int64_t sa, int64_t m, int64_t k, const bf16* w, int64_t n,
                            const bf16* bias, bf16* o, int64_t so) { amx_linear(a, sa, m, k, w, n, bias, o, so); });
#endif
#if defined(__AVX512BF16__)
        case 1:
            return stack([&](int which, const bf16* a, int64_t sa, int64_t m, int64_t k, const bf16* w, int64_t n,
                             const bf16* bias, bf16* o, int64_t so) {
                dot_linear_split(a, sa, m, k, w, n, bias, o, so, cur[which]);
            });
#endif
#if defined(__AVX2__) && defined(__FMA__)
        case 2:
            return stack([&](int which, const bf16* a, int64_t sa, int64_t m, int64_t k, const bf16* w, int64_t n,
                             const bf16* bias, bf16* o, int64_t so) {
                fma_linear(a, sa, m, k, w, n, bias, o, so, cur[which]);
            });
#endif
        default:
            return -1;
    }
}

// ``in`` (h x w x c bytes) resized to oh x ow as Pillow's Image.resize(BICUBIC) does, into
// ``out`` (oh x ow x c bytes). Pillow runs the horizontal pass first, except (from Pillow 13)
// when ``vertical_first``: the caller decides, as its Pillow would. -1 for sizes Pillow refuses.
int epd_resize_bicubic_u8(const uint8_t* in, int64_t h, int64_t w, int64_t c, uint8_t* out, int64_t oh, int64_t ow,
                          int vertical_first) {
    if (h < 1 || w < 1 || c < 1 || c > 4 || oh < 1 || ow < 1) return -1;
    if (ow == w && oh == h) {
        std::memcpy(out, in, h * w * c);
        return 0;
    }
    const Taps vt = bicubic_taps(h, oh);
    if (ow == w) {  // vertical pass only, over the input itself
        resample_columns(in, w * c, oh, vt, out);
        return 0;
    }
    const Taps ht = bicubic_taps(w, ow);
    if (oh == h) {
        resample_rows(in, w, c, 0, h, ht, ow, out);
        return 0;
    }
    if (vertical_first) {
        std::vector<uint8_t> tmp(oh * w * c);
        resample_columns(in, w * c, oh, vt, tmp.data());
        resample_rows(tmp.data(), w, c, 0, oh, ht, ow, out);
        return 0;
    }
    const int64_t first = vt.first[0], last = vt.first[oh - 1] + vt.count[oh - 1];  // input rows used
    std::vector<uint8_t> tmp((last - first) * ow * c);
    resample_rows(in, w, c, first, last, ht, ow, tmp.data());
    Taps shifted = vt;
    for (auto& f : shifted.first) f -= static_cast<int32_t>(first);
    resample_columns(tmp.data(), ow * c, oh, shifted, out);
    return 0;
}

}  // extern "C"

