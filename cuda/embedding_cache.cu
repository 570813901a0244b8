// The cache tiers' kernels: an open-addressing hash table over int64 ids (linear probing, one
// thread per key), LFU scores, row gather/scatter, the fused optimizers and the pooled lookup's
// weight gradient.
//
// Layout (see tierstore/tiers/kernel_hash_table.py): `table_keys [capacity]` int64 (EMPTY_KEY,
// TOMBSTONE_KEY or an id) beside `table_values [capacity]` (the id's row slot, int32, or row
// number, int64); `capacity` is a power of two and `mask = capacity - 1`. Rows live in
// `rows [slots, row_width]` float32, a row being `[weights (dim) | optimizer state]`; LFU scores in
// `scores [slots]` float32, one per row slot.
//
// Every kernel is a grid-stride loop over its n items (rows or elements), so any grid covers any n.
// With host_shim.h the same source compiles as C++ (tierstore/kernels/host.py): with
// TIERSTORE_OPENMP as the host tier's parallel CPU kernels (rows split over threads), without it as
// one thread running the GPU's loops (the tests' build). Loop bodies use `continue`, never
// `return`, for that reason. NVRTC compiles it for the GPU's own architecture
// (tierstore/kernels/cuda.py); every kernel is extern "C" so its name is stable.

#ifdef TIERSTORE_HOST_SHIM
#include "host_shim.h"
#endif

typedef long long i64;
typedef unsigned long long u64;

#define EMPTY_KEY (-1LL)
#define TOMBSTONE_KEY (-2LL)
#define INSERTED 0
#define ALREADY_PRESENT 1
#define TABLE_FULL 2

#ifdef TIERSTORE_OPENMP
// CPU threads (tierstore/kernels/host.py): items split over OpenMP threads, rows copied row by row.
#define GRID_STRIDE_LOOP(i, n) _Pragma("omp parallel for schedule(static)") for (i64 i = 0; i < (n); ++i)
#define FOR_EACH_ROW_ELEMENT(i, c, n, columns) GRID_STRIDE_LOOP(i, n) for (i64 c = 0; c < (columns); ++c)
// Items touch random rows and table positions, so a thread waits on memory: it asks for the
// memory of item i + AHEAD (`address`, naming `ahead`) while it works on item i.
#define AHEAD 16
#define PREFETCH_AHEAD(i, n, address)  \
    if ((i) + AHEAD < (n)) {           \
        const i64 ahead = (i) + AHEAD; \
        __builtin_prefetch(address);   \
    }
#else
#define GRID_STRIDE_LOOP(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)
#define PREFETCH_AHEAD(i, n, address)  // GPU threads hide memory latency by their number
// GPU threads: one thread per element (coalesced); the inner one-pass loop only names i and c.
#define FOR_EACH_ROW_ELEMENT(i, c, n, columns) \
    GRID_STRIDE_LOOP(element, (n) * (columns)) \
    for (i64 i = element / (columns), c = element % (columns), once = 1; once; once = 0)
#endif

// splitmix64's finaliser: spreads ids that share low bits (hashed or sequential) over the table.
__device__ __forceinline__ u64 mix(u64 x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

// Position of `key` in the table, or -1. A probe ends at the key or at an empty position;
// tombstones (removed keys) keep chains intact.
__device__ __forceinline__ i64 probe(const i64* __restrict__ table_keys, i64 mask, i64 key) {
    u64 position = mix((u64)key) & (u64)mask;
    for (i64 probes = 0; probes <= mask; ++probes) {
        i64 stored = table_keys[position];
        if (stored == key) return (i64)position;
        if (stored == EMPTY_KEY) return -1;
        position = (position + 1) & (u64)mask;
    }
    return -1;
}

// The table's operations are templates over its value type: int (`cache_*`: a cache tier's row
// slots) and i64 (`index_*`: the cold store's row numbers, which pass 2^31 in big files).

// out_values[i] = value of keys[i], or -1 where absent. Duplicate keys simply find the same value.
template <typename Value>
__device__ __forceinline__ void table_find(const i64* __restrict__ table_keys,
                                           const Value* __restrict__ table_values, i64 mask,
                                           const i64* __restrict__ keys, i64 n,
                                           Value* __restrict__ out_values) {
    GRID_STRIDE_LOOP(i, n) {
        PREFETCH_AHEAD(i, n, &table_keys[mix((u64)keys[ahead]) & (u64)mask]);
        i64 position = probe(table_keys, mask, keys[i]);
        out_values[i] = position < 0 ? (Value)-1 : table_values[position];
    }
}

// Insert keys[i] -> values[i]. Claims only empty positions (tombstones are reclaimed when the host
// side rebuilds the table), with a compare-and-swap, so two threads never take one position.
// out_status[i]: INSERTED, ALREADY_PRESENT (the key was there, or a duplicate in this batch won
// the race; its value is not written) or TABLE_FULL.
template <typename Value>
__device__ __forceinline__ void table_insert(i64* __restrict__ table_keys, Value* __restrict__ table_values,
                                             i64 mask, const i64* __restrict__ keys,
                                             const Value* __restrict__ values, i64 n,
                                             int* __restrict__ out_status) {
    GRID_STRIDE_LOOP(i, n) {
        PREFETCH_AHEAD(i, n, &table_keys[mix((u64)keys[ahead]) & (u64)mask]);
        i64 key = keys[i];
        u64 position = mix((u64)key) & (u64)mask;
        int status = TABLE_FULL;
        for (i64 probes = 0; probes <= mask; ++probes) {
            i64 stored = table_keys[position];
            if (stored == EMPTY_KEY) {
                stored = (i64)atomicCAS((u64*)&table_keys[position], (u64)EMPTY_KEY, (u64)key);
                if (stored == EMPTY_KEY) {
                    table_values[position] = values[i];
                    status = INSERTED;
                    break;
                }
            }
            if (stored == key) {
                status = ALREADY_PRESENT;
                break;
            }
            position = (position + 1) & (u64)mask;
        }
        out_status[i] = status;
    }
}

// Remove distinct keys: their positions become tombstones. out_values[i]: the value they held, or -1.
template <typename Value>
__device__ __forceinline__ void table_erase(i64* __restrict__ table_keys,
                                            const Value* __restrict__ table_values, i64 mask,
                                            const i64* __restrict__ keys, i64 n,
                                            Value* __restrict__ out_values) {
    GRID_STRIDE_LOOP(i, n) {
        PREFETCH_AHEAD(i, n, &table_keys[mix((u64)keys[ahead]) & (u64)mask]);
        i64 position = probe(table_keys, mask, keys[i]);
        out_values[i] = position < 0 ? (Value)-1 : table_values[position];
        if (position >= 0) table_keys[position] = TOMBSTONE_KEY;
    }
}

#define HASH_TABLE_KERNELS(prefix, Value)                                                     \
    extern "C" __global__ void prefix##_find(                                                 \
        const i64* __restrict__ table_keys, const Value* __restrict__ table_values, i64 mask, \
        const i64* __restrict__ keys, i64 n, Value* __restrict__ out_values) {                \
        table_find(table_keys, table_values, mask, keys, n, out_values);                      \
    }                                                                                         \
    extern "C" __global__ void prefix##_insert(                                               \
        i64* __restrict__ table_keys, Value* __restrict__ table_values, i64 mask,             \
        const i64* __restrict__ keys, const Value* __restrict__ values, i64 n,                \
        int* __restrict__ out_status) {                                                       \
        table_insert(table_keys, table_values, mask, keys, values, n, out_status);            \
    }                                                                                         \
    extern "C" __global__ void prefix##_erase(                                                \
        i64* __restrict__ table_keys, const Value* __restrict__ table_values, i64 mask,       \
        const i64* __restrict__ keys, i64 n, Value* __restrict__ out_values) {                \
        table_erase(table_keys, table_values, mask, keys, n, out_values);                     \
    }

HASH_TABLE_KERNELS(cache, int)
HASH_TABLE_KERNELS(index, i64)

// LFU: scores[slots[i]] += weights[i] (access count x the tier's current increment; see tiers/policies.py).
extern "C" __global__ void cache_touch(float* __restrict__ scores, const int* __restrict__ slots,
                                       const float* __restrict__ weights, i64 n) {
    GRID_STRIDE_LOOP(i, n) {
        PREFETCH_AHEAD(i, n, &scores[slots[ahead]]);
        atomicAdd(&scores[slots[i]], weights[i]);
    }
}

// pins[slots[i]] += delta (slots distinct; uint8 counts, wrapping as the caller's undo expects).
extern "C" __global__ void cache_pin_add(unsigned char* __restrict__ pins, const int* __restrict__ slots,
                                         i64 n, i64 delta) {
    GRID_STRIDE_LOOP(i, n) { pins[slots[i]] = (unsigned char)(pins[slots[i]] + delta); }
}

// Eviction candidates: out[s] = scores[s], or `blocked` (+inf) for a free slot (slot_keys < 0) or one
// the current batch needs (blocked_slots[s] != 0). The lowest `count` are the victims.
extern "C" __global__ void cache_victim_scores(const float* __restrict__ scores,
                                               const i64* __restrict__ slot_keys,
                                               const unsigned char* __restrict__ blocked_slots, float blocked,
                                               i64 slot_count, float* __restrict__ out) {
    GRID_STRIDE_LOOP(s, slot_count) { out[s] = (slot_keys[s] < 0 || blocked_slots[s]) ? blocked : scores[s]; }
}

// Rows are float32, or 16-bit (float16, bfloat16) values moved as their bits (`u16`): the row
// copies are templates over the element type.
typedef unsigned short u16;
typedef unsigned int u32;

#ifdef TIERSTORE_OPENMP
// CPU threads copy whole rows, with the row pointers hoisted so the copy vectorises.
template <typename Value>
__device__ __forceinline__ void copy_row(Value* __restrict__ target, const Value* __restrict__ source,
                                         i64 count) {
    for (i64 c = 0; c < count; ++c) target[c] = source[c];
}
#endif

// out[i, :columns] = rows[slots[i], :columns].
template <typename Value>
__device__ __forceinline__ void gather_rows(const Value* __restrict__ rows, i64 row_width,
                                            const int* __restrict__ slots, i64 n, i64 columns,
                                            Value* __restrict__ out) {
#ifdef TIERSTORE_OPENMP
    GRID_STRIDE_LOOP(i, n) {
        PREFETCH_AHEAD(i, n, rows + (i64)slots[ahead] * row_width);
        copy_row(out + i * columns, rows + (i64)slots[i] * row_width, columns);
    }
#else
    FOR_EACH_ROW_ELEMENT(i, c, n, columns) { out[i * columns + c] = rows[(i64)slots[i] * row_width + c]; }
#endif
}

// rows[slots[i], :columns] = values[i, :columns] (slots distinct).
template <typename Value>
__device__ __forceinline__ void scatter_rows(Value* __restrict__ rows, i64 row_width,
                                             const int* __restrict__ slots, const Value* __restrict__ values,
                                             i64 n, i64 columns) {
#ifdef TIERSTORE_OPENMP
    GRID_STRIDE_LOOP(i, n) {
        PREFETCH_AHEAD(i, n, rows + (i64)slots[ahead] * row_width);
        copy_row(rows + (i64)slots[i] * row_width, values + i * columns, columns);
    }
#else
    FOR_EACH_ROW_ELEMENT(i, c, n, columns) { rows[(i64)slots[i] * row_width + c] = values[i * columns + c]; }
#endif
}

// The gather four floats (16 bytes) at a time. Needs row_width and columns divisible by 4 and
// 16-byte aligned buffers (the launcher checks; 16-bit rows come here viewed as float32).
extern "C" __global__ void cache_gather_vec4(const float* __restrict__ rows, i64 row_width,
                                             const int* __restrict__ slots, i64 n, i64 columns,
                                             float* __restrict__ out) {
#ifdef TIERSTORE_OPENMP
    gather_rows(rows, row_width, slots, n, columns, out);
#else
    FOR_EACH_ROW_ELEMENT(i, c, n, columns / 4) {
        ((float4*)(out + i * columns))[c] = ((const float4*)(rows + (i64)slots[i] * row_width))[c];
    }
#endif
}

extern "C" __global__ void cache_gather(const float* __restrict__ rows, i64 row_width,
                                        const int* __restrict__ slots, i64 n, i64 columns,
                                        float* __restrict__ out) {
    gather_rows(rows, row_width, slots, n, columns, out);
}

extern "C" __global__ void cache_gather_16(const u16* __restrict__ rows, i64 row_width,
                                           const int* __restrict__ slots, i64 n, i64 columns,
                                           u16* __restrict__ out) {
    gather_rows(rows, row_width, slots, n, columns, out);
}

extern "C" __global__ void cache_scatter(float* __restrict__ rows, i64 row_width,
                                         const int* __restrict__ slots, const float* __restrict__ values,
                                         i64 n, i64 columns) {
    scatter_rows(rows, row_width, slots, values, n, columns);
}

extern "C" __global__ void cache_scatter_16(u16* __restrict__ rows, i64 row_width,
                                            const int* __restrict__ slots, const u16* __restrict__ values,
                                            i64 n, i64 columns) {
    scatter_rows(rows, row_width, slots, values, n, columns);
}

// Fused optimizers, in place on rows[slots[i]] = [w (dim) | state] with grad [n, dim], slots
// distinct. The formulas are tierstore/optim.py's (the reference they are tested against). Each
// element-wise optimizer is a functor updating weight c of one row (`w`, in float32) and its state
// (`state`: the row's float32 state values); APPLY_STEP runs it on every element (GPU: one thread
// per element; CPU: a thread per row, through a helper whose restrict pointers let the compiler
// keep the row in registers and vectorise).

#ifdef TIERSTORE_OPENMP
template <typename Step>
__device__ __forceinline__ void step_row(float* __restrict__ row, const float* __restrict__ g, i64 dim,
                                         Step step) {
    for (i64 c = 0; c < dim; ++c) step(row[c], row + dim, g[c], c, dim);
}
#define APPLY_STEP(step)                                                       \
    GRID_STRIDE_LOOP(i, n) {                                                   \
        PREFETCH_AHEAD(i, n, rows + (i64)slots[ahead] * row_width);            \
        step_row(rows + (i64)slots[i] * row_width, grad + i * dim, dim, step); \
    }
#else
#define APPLY_STEP(step)                                    \
    FOR_EACH_ROW_ELEMENT(i, c, n, dim) {                    \
        float* row = rows + (i64)slots[i] * row_width;      \
        step(row[c], row + dim, grad[i * dim + c], c, dim); \
    }
#endif

// w -= lr * g.
struct SgdStep {
    float lr;
    __device__ __forceinline__ void operator()(float& w, float*, float g, i64, i64) const { w -= lr * g; }
};

// s += g * g; w -= lr * g / (sqrt(s) + eps). State: s (dim values).
struct AdagradStep {
    float lr, eps;
    __device__ __forceinline__ void operator()(float& w, float* state, float g, i64 c, i64) const {
        float sum_squares = state[c] + g * g;
        state[c] = sum_squares;
        w -= lr * (g / (sqrtf(sum_squares) + eps));  // g / d first, as torch
    }
};

// Lazy Adam (torch.optim.SparseAdam): m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// w -= step_size * m / (sqrt(v) + eps), step_size = lr * sqrt(1 - b2^t) / (1 - b1^t) from the host.
// 1 - b1 and 1 - b2 come from the host too (in float32, 1.0f - 0.9f is not 0.1f). State: m, v.
struct AdamStep {
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size;
    __device__ __forceinline__ void operator()(float& w, float* state, float g, i64 c, i64 dim) const {
        float exp_avg = state[c] * beta1 + one_minus_beta1 * g;
        float exp_avg_sq = state[dim + c] * beta2 + one_minus_beta2 * g * g;
        state[c] = exp_avg;
        state[dim + c] = exp_avg_sq;
        w -= step_size * (exp_avg / (sqrtf(exp_avg_sq) + eps));  // m / d first, as torch
    }
};

// FBGEMM's exact row-wise Adagrad: m += mean(g * g); w -= lr / (sqrt(m) + eps) * g. State: m (1
// value). One thread per row (the mean is a reduction over the row): `weights` reads and writes
// weight c of the row in float32.
template <typename Weights>
__device__ __forceinline__ void rowwise_adagrad_row(Weights weights, float* state, const float* g, i64 dim,
                                                    float lr, float eps) {
    float sum = 0.0f;
    for (i64 c = 0; c < dim; ++c) sum += g[c] * g[c];
    float momentum = state[0] + sum / (float)dim;
    state[0] = momentum;
    float scale = lr / (sqrtf(momentum) + eps);
    for (i64 c = 0; c < dim; ++c) weights.set(c, weights.get(c) - scale * g[c]);
}

struct Float32Weights {
    float* row;
    __device__ __forceinline__ float get(i64 c) const { return row[c]; }
    __device__ __forceinline__ void set(i64 c, float value) const { row[c] = value; }
};

extern "C" __global__ void update_sgd(float* __restrict__ rows, i64 row_width, const int* __restrict__ slots,
                                      const float* __restrict__ grad, i64 n, i64 dim, float lr) {
    APPLY_STEP((SgdStep{lr}));
}

extern "C" __global__ void update_adagrad(float* __restrict__ rows, i64 row_width,
                                          const int* __restrict__ slots, const float* __restrict__ grad,
                                          i64 n, i64 dim, float lr, float eps) {
    APPLY_STEP((AdagradStep{lr, eps}));
}

extern "C" __global__ void update_adam(float* __restrict__ rows, i64 row_width, const int* __restrict__ slots,
                                       const float* __restrict__ grad, i64 n, i64 dim, float beta1,
                                       float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                                       float step_size) {
    APPLY_STEP((AdamStep{beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size}));
}

extern "C" __global__ void update_rowwise_adagrad(float* __restrict__ rows, i64 row_width,
                                                  const int* __restrict__ slots,
                                                  const float* __restrict__ grad, i64 n, i64 dim, float lr,
                                                  float eps) {
    GRID_STRIDE_LOOP(i, n) {
        float* row = rows + (i64)slots[i] * row_width;
        rowwise_adagrad_row(Float32Weights{row}, row + dim, grad + i * dim, dim, lr, eps);
    }
}

// 16-bit rows (float16 or bfloat16: `format`) hold their weights as 16-bit values and their
// optimizer state as float32 after them, from value dim + dim % 2 (two of the row's values each:
// tierstore/metadata.py's row_width). An update widens the weights to float32, runs the float32
// step above and rounds each weight once: to nearest even, or stochastically by a draw of (the
// row's id, the column, the step's `stream`), as tierstore/rounding.py. Conversions work on the
// bits (the same results on the GPU and the host builds, as torch's).
#define FLOAT16 0
#define BFLOAT16 1

#if defined(TIERSTORE_HOST_SHIM) && defined(__F16C__) && defined(__FLT16_MAX__)
#define HARDWARE_FLOAT16  // the CPU converts float16 itself (F16C): the same values, fewer instructions
#endif

__device__ __forceinline__ float widened(u16 bits, i64 format) {
    if (format == BFLOAT16) return __uint_as_float((u32)bits << 16);
#ifdef HARDWARE_FLOAT16
    return (float)__builtin_bit_cast(_Float16, bits);
#endif
    const u32 sign = (u32)(bits & 0x8000u) << 16, exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
    if (exponent == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
    if (exponent == 0u)
        return __uint_as_float(sign | __float_as_uint((float)mantissa * 5.9604644775390625e-8f));
    return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// The 16-bit value nearest `value` (ties to even; NaN stays NaN).
__device__ __forceinline__ u16 nearest(float value, i64 format) {
    const u32 bits = __float_as_uint(value), sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7fffffffu;
    if (format == BFLOAT16) {
        if (magnitude > 0x7f800000u) return (u16)0x7fc0u;
        return (u16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
#ifdef HARDWARE_FLOAT16
    return __builtin_bit_cast(u16, (_Float16)value);
#endif
    if (magnitude > 0x7f800000u) return (u16)(sign | 0x7e00u);
    if (magnitude >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // 65520 and up round past 65504: inf
    if (magnitude < 0x38800000u)  // below 2^-14: a multiple of 2^-24 (exact scaling, then ties to even)
        return (u16)(sign | (u32)rintf(__uint_as_float(magnitude) * 16777216.0f));
    return (u16)(sign | ((magnitude + 0xfffu + ((magnitude >> 13) & 1u) - 0x38000000u) >> 13));
}

__device__ __forceinline__ bool infinite_16(u16 bits, i64 format) {
    return (bits & 0x7fffu) == (format == BFLOAT16 ? 0x7f80u : 0x7c00u);
}

#define GOLDEN 0x9E3779B97F4A7C15ULL

// SplitMix64 (its increment, then the finaliser), as tierstore/initializer.py's splitmix64.
__device__ __forceinline__ u64 splitmix64(u64 x) { return mix(x + GOLDEN); }

// tierstore/initializer.py's unit_draws: id's draws for the purpose `stream` (draws_of), then a
// float64 in [0, 1) from 53 hashed bits of them and a column (unit_draw).
__device__ __forceinline__ u64 draws_of(i64 id, u64 stream) {
    return splitmix64((u64)id * 0x5851F42D4C957F2DULL + stream);
}

__device__ __forceinline__ double unit_draw(u64 draws, i64 column) {
    return (double)(splitmix64(draws + (u64)column * GOLDEN) >> 11) * 0x1.0p-53;
}

// One of the two 16-bit values around `value`, the upper with probability its distance from the
// lower over their gap; values held exactly, non-finite ones and those next to infinity round to nearest.
__device__ __forceinline__ u16 stochastically(float value, i64 format, i64 id, u64 stream, i64 column) {
    const u16 near = nearest(value, format);
    const float near_value = widened(near, format);
    if (near_value == value || !(fabsf(value) <= 3.402823466e38f) || infinite_16(near, format)) return near;
    // the other neighbour: one step away from zero where rounding went toward it, else toward zero
    const u16 other = (u16)(fabsf(near_value) < fabsf(value) ? near + 1 : near - 1);
    if (infinite_16(other, format)) return near;
    const float other_value = widened(other, format);
    const bool near_is_low = near_value < other_value;
    const double low = near_is_low ? near_value : other_value, high = near_is_low ? other_value : near_value;
    const bool up = unit_draw(draws_of(id, stream), column) < ((double)value - low) / (high - low);
    return up == near_is_low ? other : near;
}

struct HalfRounding {
    i64 format;
    const i64* keys;  // the rows' ids (stochastic rounding)
    u64 stream;
    i64 stochastic;
    __device__ __forceinline__ u16 operator()(float value, i64 i, i64 column) const {
        return stochastic ? stochastically(value, format, keys[i], stream, column) : nearest(value, format);
    }
};

__device__ __forceinline__ float* float32_state(u16* row, i64 dim) { return (float*)(row + dim + (dim & 1)); }

#ifdef TIERSTORE_OPENMP
// A CPU thread's row, a chunk of weights at a time: widened, stepped and rounded in three loops
// the compiler vectorises.
template <typename Step>
__device__ __forceinline__ void step_row_16(u16* __restrict__ row, const float* __restrict__ g, i64 dim,
                                            Step step, HalfRounding rounding, i64 i) {
    const i64 chunk = 16;
    float* __restrict__ state = float32_state(row, dim);
    float w[chunk];
    for (i64 start = 0; start < dim; start += chunk) {
        const i64 count = dim - start < chunk ? dim - start : chunk;
        u16* __restrict__ weights = row + start;
        for (i64 k = 0; k < count; ++k) w[k] = widened(weights[k], rounding.format);
        for (i64 k = 0; k < count; ++k) step(w[k], state, g[start + k], start + k, dim);
        if (rounding.stochastic) {
            for (i64 k = 0; k < count; ++k) weights[k] = rounding(w[k], i, start + k);
        } else {
            for (i64 k = 0; k < count; ++k) weights[k] = nearest(w[k], rounding.format);
        }
    }
}
#define APPLY_STEP_16(step)                                                                    \
    GRID_STRIDE_LOOP(i, n) {                                                                   \
        PREFETCH_AHEAD(i, n, rows + (i64)slots[ahead] * row_width);                            \
        step_row_16(rows + (i64)slots[i] * row_width, grad + i * dim, dim, step, rounding, i); \
    }
#else
#define APPLY_STEP_16(step)                                          \
    FOR_EACH_ROW_ELEMENT(i, c, n, dim) {                             \
        u16* row = rows + (i64)slots[i] * row_width;                 \
        float w = widened(row[c], rounding.format);                  \
        step(w, float32_state(row, dim), grad[i * dim + c], c, dim); \
        row[c] = rounding(w, i, c);                                  \
    }
#endif

// The 16-bit kernels take, after the float32 kernels' first arguments: format, keys [n] (int64,
// read only for stochastic rounding), stream and stochastic; then the optimizer's floats.
#define HALF_ARGUMENTS                                                                                    \
    u16 *__restrict__ rows, i64 row_width, const int *__restrict__ slots, const float *__restrict__ grad, \
        i64 n, i64 dim, i64 format, const i64 *__restrict__ keys, i64 stream, i64 stochastic
#define HALF_ROUNDING \
    const HalfRounding rounding { format, keys, (u64)stream, stochastic }

extern "C" __global__ void update_sgd_16(HALF_ARGUMENTS, float lr) {
    HALF_ROUNDING;
    APPLY_STEP_16((SgdStep{lr}));
}

extern "C" __global__ void update_adagrad_16(HALF_ARGUMENTS, float lr, float eps) {
    HALF_ROUNDING;
    APPLY_STEP_16((AdagradStep{lr, eps}));
}

extern "C" __global__ void update_adam_16(HALF_ARGUMENTS, float beta1, float one_minus_beta1, float beta2,
                                          float one_minus_beta2, float eps, float step_size) {
    HALF_ROUNDING;
    APPLY_STEP_16((AdamStep{beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size}));
}

struct HalfWeights {
    u16* row;
    HalfRounding rounding;
    i64 i;
    __device__ __forceinline__ float get(i64 c) const { return widened(row[c], rounding.format); }
    __device__ __forceinline__ void set(i64 c, float value) const { row[c] = rounding(value, i, c); }
};

extern "C" __global__ void update_rowwise_adagrad_16(HALF_ARGUMENTS, float lr, float eps) {
    HALF_ROUNDING;
    GRID_STRIDE_LOOP(i, n) {
        u16* row = rows + (i64)slots[i] * row_width;
        rowwise_adagrad_row(HalfWeights{row, rounding, i}, float32_state(row, dim), grad + i * dim, dim, lr,
                            eps);
    }
}

// Backward of a pooled lookup (embedding bag, or plain embedding: one entry per bag) for the
// weight: grad_weight[r, :] = sum over the entries j that read row r of scale[j] * grad_out[bag[j], :].
// The entries of row r are order[starts[r]] .. order[starts[r + 1] - 1] (entries sorted by row),
// so each row is summed by one thread (GPU: one per element) without atomics. scale[j]: the
// per-sample weight, 1 / bag length for mode "mean", or 1. grad_out [bags, dim] with bag b's row at
// grad_out + b * grad_stride (a slice of a wider gradient is read in place), grad_weight [rows, dim].
#ifdef TIERSTORE_OPENMP
__device__ __forceinline__ void sum_entries(float* __restrict__ target, const float* __restrict__ grad_out,
                                            const i64* __restrict__ entries, i64 count,
                                            const i64* __restrict__ bag, const float* __restrict__ scale,
                                            i64 dim, i64 grad_stride) {
    for (i64 c = 0; c < dim; ++c) target[c] = 0.0f;
    for (i64 e = 0; e < count; ++e) {
        const float* __restrict__ source = grad_out + bag[entries[e]] * grad_stride;
        float weight = scale[entries[e]];
        for (i64 c = 0; c < dim; ++c) target[c] += weight * source[c];
    }
}
#endif

extern "C" __global__ void bag_weight_gradient(const float* __restrict__ grad_out,
                                               const i64* __restrict__ order, const i64* __restrict__ starts,
                                               const i64* __restrict__ bag, const float* __restrict__ scale,
                                               i64 rows, i64 dim, i64 grad_stride,
                                               float* __restrict__ grad_weight) {
#ifdef TIERSTORE_OPENMP
    // Rows differ in entry count by orders of magnitude (skewed ids): threads take rows in chunks as they go.
    const i64 entries = starts[rows];
#pragma omp parallel for schedule(dynamic, 256)
    for (i64 r = 0; r < rows; ++r) {
        // the gradient rows of the entries AHEAD places on (whichever rows they belong to)
        const i64 first = starts[r] + AHEAD < entries ? starts[r] + AHEAD : entries;
        const i64 last = starts[r + 1] + AHEAD < entries ? starts[r + 1] + AHEAD : entries;
        for (i64 e = first; e < last; ++e) {
            for (i64 c = 0; c < dim; c += 16) __builtin_prefetch(grad_out + bag[order[e]] * grad_stride + c);
        }
        sum_entries(grad_weight + r * dim, grad_out, order + starts[r], starts[r + 1] - starts[r], bag, scale,
                    dim, grad_stride);
    }
#else
    FOR_EACH_ROW_ELEMENT(r, c, rows, dim) {
        float sum = 0.0f;
        for (i64 e = starts[r]; e < starts[r + 1]; ++e)
            sum += scale[order[e]] * grad_out[bag[order[e]] * grad_stride + c];
        grad_weight[r * dim + c] = sum;
    }
#endif
}
