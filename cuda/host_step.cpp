// A CPU training step's own passes, built with the kernels into the host tier's library (the
// OpenMP build of tierstore/kernels/host.py; called from tierstore/nn/native_step.py):
// - step_distinct: a batch's distinct ids by hashing (in parts, on the OpenMP team), each entry's
//   distinct row, and the entries grouped by row (a counting sort: ascending entries in a row);
// - step_pooled_forward: every bag's pooled sum or mean, read straight from the host tier's rows;
// - step_backward: each distinct row's gradient summed from its entries and the fused optimizer
//   applied to the row in place, in one pass (or the sums written out, to be applied elsewhere);
// - step_cold_rows / step_cold_stage: the mmap cold store's batched read and log staging;
// - step_make_resident: a batch's rows made resident in a host tier in one call: found, the misses'
//   victims chosen (LFU), their rows read from the mmap cold store into their slots and the
//   victims' dirty rows staged in its log (step_admit_cold);
// - step_lookup_bags: a training lookup in one call: distinct ids, made resident, bags pooled.
// Results do not depend on the thread count: one thread sums each bag and each row, in entry order.
// It also holds the host cache tier's own calls (host_cache.cpp), a lookahead horizon's
// (host_horizon.cpp) and LFU's shadow caches (host_ageing.cpp).

#include <omp.h>
#include <sched.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "embedding_cache.cu"

#define PARALLEL_FROM 1024  // items: fewer run on the calling thread (waking a team costs more)
#define SECTIONS_FROM 256   // victims: fewer keep an admission's log writes and index changes on one thread
#define REWRITE_RUN 64      // records: a thread's share of an admission's rewrites in place, at a time
#define PAGE_RUN 65536      // bytes: a thread's share of the log's pages made ahead of its appends, at a time
#define PAGES_AHEAD 2       // an admission makes the log's pages for this many times its own appends ahead
#define SPINS_BEFORE_YIELD 4096  // a thread waiting on another's write spins this long, then yields

// Ask for every cache line of [address, address + bytes) (bytes > 0): rows wider than a line (dim 64
// and more), or not starting on one, would otherwise wait on each line after the first.
template <int Write = 0>
PREFETCHING void prefetch_lines(const void* address, i64 bytes) {
    const uintptr_t last = (uintptr_t)address + (uintptr_t)bytes - 1;
    for (uintptr_t line = (uintptr_t)address & ~(uintptr_t)63; line <= last; line += 64)
        __builtin_prefetch((const void*)line, Write);
}

// Room for n items of a trivial type, not zeroed: for scratch whose every item is written before it
// is read (a std::vector would clear it first).
template <typename T>
struct Room {
    std::unique_ptr<T[]> items;
    explicit Room(i64 n) : items(new T[n > 0 ? n : 1]) {}
    T* data() const { return items.get(); }
    T& operator[](i64 i) const { return items[i]; }
};

#include "host_cache.cpp"
#include "host_horizon.cpp"
#include "host_ageing.cpp"

// The row of `key` (its mix: `hash`) among unique[0..distinct) (first-appearance order), found through
// `table` (scratch of int32 positions, each 0 or a row + 1); a new key is written as row `distinct`
// (the caller counts it: the returned row equals `distinct`).
static inline i64 distinct_row(int* __restrict__ table, i64 mask, i64* __restrict__ unique, i64 distinct,
                               i64 key, u64 hash) {
    u64 position = hash & (u64)mask;
    while (table[position] != 0 && unique[table[position] - 1] != key) position = (position + 1) & (u64)mask;
    if (table[position] == 0) {
        table[position] = (int)(distinct + 1);
        unique[distinct] = key;
        return distinct;
    }
    return table[position] - 1;
}

// The mixes of a run of keys, each computed once: the key AHEAD on is mixed (and its table position
// asked for) as the current one is probed with the mix it got AHEAD keys before.
struct MixRing {
    u64 ring[AHEAD];
    template <typename KeyAt>
    MixRing(KeyAt key_at, i64 count) {
        for (i64 i = 0; i < AHEAD && i < count; ++i) ring[i] = mix((u64)key_at(i));
    }
    // The mix of key i; the ring then holds key i + AHEAD's (asking for its position in `table`).
    template <typename KeyAt>
    inline u64 take(i64 i, i64 count, KeyAt key_at, const int* table, i64 mask) {
        const u64 hash = ring[i % AHEAD];
        if (i + AHEAD < count) {
            const u64 ahead = mix((u64)key_at(i + AHEAD));
            ring[i % AHEAD] = ahead;
            __builtin_prefetch(&table[ahead & (u64)mask]);
        }
        return hash;
    }
};

// A small batch's dedupe on the calling thread: step_distinct's results, rows in first-appearance
// order, through one table of mask + 1 >= 2n positions (scratch).
static i64 distinct_serial(const i64* __restrict__ ids, i64 n, i64 padding, int has_padding,
                           int* __restrict__ table, i64 mask, i64* __restrict__ unique,
                           i64* __restrict__ counts, i64* __restrict__ entry_rows, i64* __restrict__ starts,
                           i64* __restrict__ order) {
    for (i64 p = 0; p <= mask; ++p) table[p] = 0;
    i64 distinct = 0;
    auto key_at = [ids](i64 e) { return ids[e]; };
    MixRing mixes(key_at, n);
    for (i64 e = 0; e < n; ++e) {
        const u64 hash = mixes.take(e, n, key_at, table, mask);
        const i64 key = ids[e];
        if (has_padding && key == padding) {
            entry_rows[e] = -1;
            continue;
        }
        const i64 row = distinct_row(table, mask, unique, distinct, key, hash);
        if (row == distinct) counts[distinct++] = 0;  // a new row
        counts[row] += 1;
        entry_rows[e] = row;
    }
    starts[0] = 0;
    for (i64 r = 0; r < distinct; ++r) starts[r + 1] = starts[r] + counts[r];
    int* __restrict__ next = table;  // the table is done with: each row's next place in order
    for (i64 r = 0; r < distinct; ++r) next[r] = (int)starts[r];
    for (i64 e = 0; e < n; ++e) {
        const i64 row = entry_rows[e];
        if (row < 0) {
            entry_rows[e] = distinct;
        } else {
            order[next[row]++] = e;
        }
    }
    if (has_padding) starts[distinct + 1] = starts[distinct];
    return distinct;
}

// A large batch's dedupe splits its ids by hash into DISTINCT_PARTS parts, each part's rows found on
// one thread: a fixed number, so the rows' order depends on the ids alone, not on the thread count.
// Smaller batches run distinct_serial (splitting costs more than a second thread saves there).
#define DISTINCT_IN_PARTS_FROM 16384  // entries
#define DISTINCT_PARTS 8
#define DISTINCT_PART_BITS 3  // log2(DISTINCT_PARTS): a key's part is the top bits of its hash

// Whether step_distinct deduplicates n ids on the calling thread (distinct_serial).
static inline bool distinct_on_one_thread(i64 n) { return n < DISTINCT_IN_PARTS_FROM; }

static inline int distinct_part(i64 key) { return (int)(mix((u64)key) >> (64 - DISTINCT_PART_BITS)); }

// Where in step_distinct's int32 scratch for n ids each entry's part (a byte an entry) starts: after
// each part's entries and their rows within the part (2n), and each part's hash table (a power of
// two of at least twice its entries and 16: at most 4n + 16 a part in all).
static inline i64 distinct_parts_at(i64 n) { return 6 * n + 32 * DISTINCT_PARTS; }

// int32 scratch step_distinct needs for n ids.
extern "C" i64 step_distinct_scratch(i64 n) { return distinct_parts_at(n) + n / 4 + 1; }

// Distinct ids of ids[0..n) leaving out entries equal to `padding` (when has_padding): unique[U]
// in first-appearance order (n < DISTINCT_IN_PARTS_FROM) or part by part (DISTINCT_PARTS of the
// ids' hashes), in first-appearance order within a part, and counts[U]; entry_rows[e] is entry e's distinct
// row (U for padding entries); starts[U + 1] (U + 2 with padding: the padding row has no entries) and
// order[M]: the non-padding entries, row by row, ascending within a row. `scratch`: step_distinct_scratch(n)
// int32s; each part's table holds 0 or a distinct row + 1 a position (4 bytes keep it in L2 where pairs of
// keys and rows would not). Threads write only runs of memory of their own (entries of different parts lie
// side by side: writing each entry's row from its part's thread would share every cache line). n < 2^31.
// Returns U.
extern "C" i64 step_distinct(const i64* __restrict__ ids, i64 n, i64 padding, int has_padding,
                             int* __restrict__ scratch, i64* __restrict__ unique, i64* __restrict__ counts,
                             i64* __restrict__ entry_rows, i64* __restrict__ starts,
                             i64* __restrict__ order) {
    if (distinct_on_one_thread(n)) {
        i64 positions = 16;
        while (positions < 2 * n) positions *= 2;
        return distinct_serial(ids, n, padding, has_padding, scratch, positions - 1, unique, counts,
                               entry_rows, starts, order);
    }
    const int P = DISTINCT_PARTS;
    int* __restrict__ bucket = scratch;           // the kept entries, part by part, ascending in a part
    int* __restrict__ bucket_rows = scratch + n;  // their rows within their part
    unsigned char* __restrict__ part_of = (unsigned char*)(scratch + distinct_parts_at(n));
    const int threads = omp_get_max_threads();
    std::vector<i64> histogram((size_t)threads * P, 0);  // [run, part]: entries, then where they go
    i64 part_entries[DISTINCT_PARTS + 1];                // where each part's entries start in bucket
    int runs = 1;                                        // the runs of entries, one a thread
    // 1. The entries bucketed by part, each thread counting, then placing, its own run of them.
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        const i64 first = n * t / team, last = n * (t + 1) / team;
        i64 mine[DISTINCT_PARTS] = {0};  // this run's: counted, then where its next entry goes
        for (i64 e = first; e < last; ++e) {
            const int p = distinct_part(ids[e]);
            part_of[e] = (unsigned char)p;
            mine[p] += !(has_padding && ids[e] == padding);
        }
        for (int p = 0; p < P; ++p) histogram[(size_t)t * P + p] = mine[p];
#pragma omp barrier
#pragma omp single
        {
            runs = team;
            i64 running = 0;
            for (int p = 0; p < P; ++p) {
                part_entries[p] = running;
                for (int u = 0; u < team; ++u) {
                    const i64 count = histogram[(size_t)u * P + p];
                    histogram[(size_t)u * P + p] = running;
                    running += count;
                }
            }
            part_entries[P] = running;
        }
        for (int p = 0; p < P; ++p) mine[p] = histogram[(size_t)t * P + p];
        for (i64 e = first; e < last; ++e)
            if (!(has_padding && ids[e] == padding)) bucket[mine[part_of[e]]++] = (int)e;
    }
    i64 table_start[DISTINCT_PARTS + 1], part_rows[DISTINCT_PARTS], row_base[DISTINCT_PARTS + 1];
    table_start[0] = 2 * n;
    for (int p = 0; p < P; ++p) {
        i64 size = 16;
        while (size < 2 * (part_entries[p + 1] - part_entries[p])) size *= 2;
        table_start[p + 1] = table_start[p] + size;
    }
    // 2. Each part deduplicated on its own, its rows written from where its entries start (a bound
    // on the rows before it).
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int p = 0; p < P; ++p) {
        int* __restrict__ table = scratch + table_start[p];
        const i64 mask = table_start[p + 1] - table_start[p] - 1;
        for (i64 q = 0; q <= mask; ++q) table[q] = 0;
        i64* __restrict__ part_unique = unique + part_entries[p];
        i64* __restrict__ part_counts = counts + part_entries[p];
        i64 distinct = 0;
        const i64 first = part_entries[p], count = part_entries[p + 1] - first;
        auto key_at = [ids, bucket, first](i64 k) { return ids[bucket[first + k]]; };
        MixRing mixes(key_at, count);
        for (i64 k = part_entries[p]; k < part_entries[p + 1]; ++k) {
            const u64 hash = mixes.take(k - first, count, key_at, table, mask);
            const i64 row = distinct_row(table, mask, part_unique, distinct, ids[bucket[k]], hash);
            if (row == distinct) part_counts[distinct++] = 0;  // a new row
            part_counts[row] += 1;
            bucket_rows[k] = (int)row;
        }
        part_rows[p] = distinct;
    }
    row_base[0] = 0;
    for (int p = 0; p < P; ++p) {  // the parts' rows side by side (each moves down, in part order)
        row_base[p + 1] = row_base[p] + part_rows[p];
        std::memmove(unique + row_base[p], unique + part_entries[p], part_rows[p] * sizeof(i64));
        std::memmove(counts + row_base[p], counts + part_entries[p], part_rows[p] * sizeof(i64));
    }
    const i64 distinct = row_base[P];
    // 3. Each part's rows' starts and its entries grouped by row (a counting sort), on one thread.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int p = 0; p < P; ++p) {
        int* __restrict__ next = scratch + table_start[p];  // each row's next place in order
        i64 place = part_entries[p];
        for (i64 r = 0; r < part_rows[p]; ++r) {
            starts[row_base[p] + r] = place;
            next[r] = (int)place;
            place += counts[row_base[p] + r];
        }
        for (i64 k = part_entries[p]; k < part_entries[p + 1]; ++k) order[next[bucket_rows[k]]++] = bucket[k];
    }
    starts[distinct] = part_entries[P];
    if (has_padding) starts[distinct + 1] = starts[distinct];
    // 4. Each entry's row, run by run as step 1 placed them.
#pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int t = 0; t < runs; ++t) {
        i64 next[DISTINCT_PARTS];
        for (int p = 0; p < P; ++p) next[p] = histogram[(size_t)t * P + p];
        for (i64 e = n * t / runs; e < n * (t + 1) / runs; ++e) {
            if (has_padding && ids[e] == padding) {
                entry_rows[e] = distinct;
                continue;
            }
            const int p = part_of[e];
            entry_rows[e] = row_base[p] + bucket_rows[next[p]++];
        }
    }
    return distinct;
}

// The distinct ids of ids[0..n) into unique[0..U), in first-appearance order, U returned: the
// dedupe of step_distinct without its per-entry rows and grouping (a lookahead's keys). `table`:
// scratch of mask + 1 >= 2n int32 positions, as step_distinct's.
extern "C" i64 step_unique(const i64* __restrict__ ids, i64 n, int* __restrict__ table, i64 mask,
                           i64* __restrict__ unique) {
    for (i64 p = 0; p <= mask; ++p) table[p] = 0;
    i64 distinct = 0;
    auto key_at = [ids](i64 e) { return ids[e]; };
    MixRing mixes(key_at, n);
    for (i64 e = 0; e < n; ++e) {
        const u64 hash = mixes.take(e, n, key_at, table, mask);
        distinct += distinct_row(table, mask, unique, distinct, ids[e], hash) == distinct;
    }
    return distinct;
}

// out[b, :dim] (bag b's output at out + b * out_stride) = the sum, or the mean (`mean`), of its
// entries' rows rows[slots[entry_rows[e]], :dim], each times weights[e] when weights is not null;
// entries reading `padding_row` are left out (an empty bag pools to zeros). Bag b holds entries
// offsets[b] .. offsets[b + 1] - 1, the last bag up to last_end - 1; without offsets (null), bag b
// holds entries b * bag_length .. (b + 1) * bag_length - 1. Writes each entry's bag (-1: in none)
// and its gradient scale (its weight, 1 / the bag's entries for a mean, 1; 0 for padding), and
// returns 0; or, where every entry is a bag of its own with scale 1 (one entry a bag, no weights,
// none past the last bag), writes neither and returns 1: step_backward then takes no bags (null).
// Rows are float32 (format FLOAT32) or 16-bit (FLOAT16, BFLOAT16: embedding_cache.cu's), read as
// float32 and written back rounded (update_row).
#define FLOAT32 (-1)

__device__ __forceinline__ float row_value(const float* row, i64 c, i64) { return row[c]; }
__device__ __forceinline__ float row_value(const u16* row, i64 c, i64 format) {
    return widened(row[c], format);
}

static inline i64 row_bytes_of(i64 row_width, i64 format) {
    return row_width * (format == FLOAT32 ? (i64)sizeof(float) : (i64)sizeof(u16));
}

// Whether bag b holds entry b alone, for every bag (one-hot features: the common case).
static bool one_entry_each(const i64* __restrict__ offsets, i64 bag_length, i64 last_end, i64 bags) {
    if (!offsets) return bag_length == 1;
    if (last_end != bags) return false;
    i64 differs = 0;  // a branch-free OR the compiler vectorizes
    for (i64 b = 0; b < bags; ++b) differs |= offsets[b] ^ b;
    return differs == 0;
}

// pooled_forward (below) where bag b holds entry b alone: each output a row, times its weight,
// added to zero as the general loop adds it (-0.0 pools to 0.0), without that loop's per-bag setup;
// the bags and gradient scales as it sets them (a mean's share is 1), where entry_bag and scale are
// not null.
template <typename Row>
static void one_entry_bags(const Row* __restrict__ rows, i64 format, i64 row_width, i64 dim,
                           const i64* __restrict__ slots, const i64* __restrict__ entry_rows, i64 padding_row,
                           i64 bags, i64 entries, int mean, const float* __restrict__ weights,
                           float* __restrict__ out, i64 out_stride, i64* __restrict__ entry_bag,
                           float* __restrict__ scale) {
#pragma omp parallel for schedule(static) if (bags >= PARALLEL_FROM)
    for (i64 b = 0; b < bags; ++b) {
        const i64 ahead = b + AHEAD;
        if (ahead < entries && entry_rows[ahead] != padding_row)
            prefetch_lines(rows + slots[entry_rows[ahead]] * row_width, dim * (i64)sizeof(Row));
        float* __restrict__ target = out + b * out_stride;
        const i64 row = entry_rows[b];
        if (entry_bag) entry_bag[b] = b;
        if (row == padding_row) {
            if (scale) scale[b] = 0.0f;
            for (i64 c = 0; c < dim; ++c) target[c] = 0.0f;
            continue;
        }
        const Row* __restrict__ source = rows + slots[row] * row_width;
        const float weight = weights ? weights[b] : 1.0f;
        if (scale) scale[b] = mean ? 1.0f : weight;
        if (weights) {
            for (i64 c = 0; c < dim; ++c) target[c] = 0.0f + weight * row_value(source, c, format);
        } else {
            for (i64 c = 0; c < dim; ++c) target[c] = 0.0f + row_value(source, c, format);
        }
    }
}

// pooled_forward (below) for bags of any length.
template <typename Row>
static void any_bags(const Row* __restrict__ rows, i64 format, i64 row_width, i64 dim,
                     const i64* __restrict__ slots, const i64* __restrict__ entry_rows, i64 padding_row,
                     const i64* __restrict__ offsets, i64 bag_length, i64 last_end, i64 bags, i64 entries,
                     int mean, const float* __restrict__ weights, float* __restrict__ out, i64 out_stride,
                     i64* __restrict__ entry_bag, float* __restrict__ scale) {
#pragma omp parallel for schedule(static) if (bags >= PARALLEL_FROM)
    for (i64 b = 0; b < bags; ++b) {
        const i64 start = offsets ? offsets[b] : b * bag_length;
        const i64 end = offsets ? (b + 1 < bags ? offsets[b + 1] : last_end) : start + bag_length;
        float* __restrict__ target = out + b * out_stride;
        for (i64 c = 0; c < dim; ++c) target[c] = 0.0f;
        i64 kept = 0;
        for (i64 e = start; e < end; ++e) {
            const i64 ahead = e + AHEAD;  // entries lie in bag order: whichever bag this one is in
            if (ahead < entries && entry_rows[ahead] != padding_row) {
                prefetch_lines(rows + slots[entry_rows[ahead]] * row_width, dim * (i64)sizeof(Row));
            }
            entry_bag[e] = b;
            const i64 row = entry_rows[e];
            if (row == padding_row) {
                scale[e] = 0.0f;
                continue;
            }
            const Row* __restrict__ source = rows + slots[row] * row_width;
            if (weights) {
                const float weight = weights[e];
                scale[e] = weight;
                for (i64 c = 0; c < dim; ++c) target[c] += weight * row_value(source, c, format);
            } else {
                scale[e] = 1.0f;
                for (i64 c = 0; c < dim; ++c) target[c] += row_value(source, c, format);
            }
            ++kept;
        }
        if (mean && kept > 0) {
            const float share = 1.0f / (float)kept;
            for (i64 c = 0; c < dim; ++c) target[c] /= (float)kept;
            for (i64 e = start; e < end; ++e) scale[e] = scale[e] == 0.0f ? 0.0f : share;
        }
    }
}

template <typename Row>
static i64 pooled_forward(const Row* __restrict__ rows, i64 format, i64 row_width, i64 dim,
                          const i64* __restrict__ slots, const i64* __restrict__ entry_rows, i64 padding_row,
                          const i64* __restrict__ offsets, i64 bag_length, i64 last_end, i64 bags,
                          i64 entries, int mean, const float* __restrict__ weights, float* __restrict__ out,
                          i64 out_stride, i64* __restrict__ entry_bag, float* __restrict__ scale) {
    if (one_entry_each(offsets, bag_length, last_end, bags)) {
        const bool own_bags = !weights && last_end == entries;  // entry e: bag e, scale 1 (or padding)
        one_entry_bags(rows, format, row_width, dim, slots, entry_rows, padding_row, bags, entries, mean,
                       weights, out, out_stride, own_bags ? nullptr : entry_bag, own_bags ? nullptr : scale);
        if (own_bags) return 1;
    } else {
        any_bags(rows, format, row_width, dim, slots, entry_rows, padding_row, offsets, bag_length, last_end,
                 bags, entries, mean, weights, out, out_stride, entry_bag, scale);
    }
    for (i64 e = last_end; e < entries; ++e) {  // past the last bag (include_last_offset)
        entry_bag[e] = -1;
        scale[e] = 0.0f;
    }
    return 0;
}

// The pooled forward (above) over rows of `format`, summed in float32.
extern "C" i64 step_pooled_forward(const void* __restrict__ rows, i64 format, i64 row_width, i64 dim,
                                   const i64* __restrict__ slots, const i64* __restrict__ entry_rows,
                                   i64 padding_row, const i64* __restrict__ offsets, i64 bag_length,
                                   i64 last_end, i64 bags, i64 entries, int mean,
                                   const float* __restrict__ weights, float* __restrict__ out, i64 out_stride,
                                   i64* __restrict__ entry_bag, float* __restrict__ scale) {
    if (format == FLOAT32)
        return pooled_forward((const float*)rows, format, row_width, dim, slots, entry_rows, padding_row,
                              offsets, bag_length, last_end, bags, entries, mean, weights, out, out_stride,
                              entry_bag, scale);
    return pooled_forward((const u16*)rows, format, row_width, dim, slots, entry_rows, padding_row, offsets,
                          bag_length, last_end, bags, entries, mean, weights, out, out_stride, entry_bag,
                          scale);
}

// The element-wise optimizers of embedding_cache.cu by number (tierstore/kernels/step_passes.py's
// _OPTIMIZER_CODES: 0 SGD, 1 Adagrad, 2 Adam), built from params (the float arguments their kernels
// take) and handed to `apply`.
template <typename Apply>
__device__ __forceinline__ void with_elementwise_step(int optimizer, const float* __restrict__ params,
                                                      Apply apply) {
    switch (optimizer) {
        case 0:
            apply(SgdStep{params[0]});
            break;
        case 1:
            apply(AdagradStep{params[0], params[1]});
            break;
        default:
            apply(AdamStep{params[0], params[1], params[2], params[3], params[4], params[5]});
    }
}

#define ROWWISE_ADAGRAD 3

// Optimizer `optimizer` on one row with its summed gradient g, as the update kernels apply it: a
// float32 row (`rounding` and `slot` unused), or a 16-bit one rounded by `rounding` (its keys are
// the tier's slot keys, the rows' ids; `slot` the row's).
__device__ __forceinline__ void update_row(float* __restrict__ row, const float* __restrict__ g, i64 dim,
                                           int optimizer, const float* __restrict__ params,
                                           const HalfRounding&, i64) {
    if (optimizer == ROWWISE_ADAGRAD) {
        rowwise_adagrad_row(Float32Weights{row}, row + dim, g, dim, params[0], params[1]);
        return;
    }
    with_elementwise_step(optimizer, params, [&](auto step) { step_row(row, g, dim, step); });
}

__device__ __forceinline__ void update_row(u16* __restrict__ row, const float* __restrict__ g, i64 dim,
                                           int optimizer, const float* __restrict__ params,
                                           const HalfRounding& rounding, i64 slot) {
    if (optimizer == ROWWISE_ADAGRAD) {
        rowwise_adagrad_row(HalfWeights{row, rounding, slot}, float32_state(row, dim), g, dim, params[0],
                            params[1]);
        return;
    }
    with_elementwise_step(optimizer, params,
                          [&](auto step) { step_row_16(row, g, dim, step, rounding, slot); });
}

// Row r's gradient: the sum over its entries (order[starts[r]] .. order[starts[r + 1] - 1], in
// that order) of scale[e] * grad_out[entry_bag[e]] (bag b's gradient at grad_out + b * grad_stride;
// entries in no bag are left out; entry_bag and scale null: entry e is bag e, of scale 1, as
// step_pooled_forward's result 1 says), as bag_weight_gradient sums it. With grad_rows (not null) the
// sums are written there ([distinct, dim]); otherwise `optimizer` updates rows[slots[r]] in place
// and marks the slot dirty (16-bit rows: rounded by `rounding`, whose keys are the slots' keys).
template <typename Row>
static void backward(const float* __restrict__ grad_out, i64 grad_stride, const i64* __restrict__ order,
                     const i64* __restrict__ starts, const i64* __restrict__ entry_bag,
                     const float* __restrict__ scale, i64 distinct, i64 dim, Row* __restrict__ rows,
                     i64 row_width, const i64* __restrict__ slots, unsigned char* __restrict__ dirty,
                     int optimizer, const float* __restrict__ params, const HalfRounding& rounding,
                     float* __restrict__ grad_rows) {
#pragma omp parallel if (distinct >= PARALLEL_FROM)
    {
        std::vector<float> buffer(grad_rows ? 0 : dim);
#pragma omp for schedule(dynamic, 256)
        for (i64 r = 0; r < distinct; ++r) {
            const i64 entries = starts[distinct];
            const i64 ahead = starts[r + 1] + AHEAD < entries ? starts[r + 1] + AHEAD : entries;
            for (i64 e = starts[r] + AHEAD < entries ? starts[r] + AHEAD : entries; e < ahead; ++e) {
                const i64 bag = entry_bag ? entry_bag[order[e]] : order[e];
                if (bag >= 0) prefetch_lines(grad_out + bag * grad_stride, dim * (i64)sizeof(float));
            }
            if (!grad_rows && r + AHEAD / 4 < distinct) {
                prefetch_lines<1>(rows + slots[r + AHEAD / 4] * row_width, row_width * (i64)sizeof(Row));
            }
            float* __restrict__ g = grad_rows ? grad_rows + r * dim : buffer.data();
            for (i64 c = 0; c < dim; ++c) g[c] = 0.0f;
            for (i64 e = starts[r]; e < starts[r + 1]; ++e) {
                const i64 entry = order[e];
                if (!entry_bag) {  // the entry is its bag, of scale 1
                    const float* __restrict__ source = grad_out + entry * grad_stride;
                    for (i64 c = 0; c < dim; ++c) g[c] += source[c];
                    continue;
                }
                const i64 bag = entry_bag[entry];
                if (bag < 0) continue;
                const float* __restrict__ source = grad_out + bag * grad_stride;
                const float weight = scale[entry];
                for (i64 c = 0; c < dim; ++c) g[c] += weight * source[c];
            }
            if (!grad_rows) {
                update_row(rows + slots[r] * row_width, g, dim, optimizer, params, rounding, slots[r]);
                dirty[slots[r]] = 1;
            }
        }
    }
}

// backward (above) on rows of `format`: 16-bit rows rounded to nearest, or stochastically
// (`stochastic`, drawing by slot_keys and `stream`, as the _16 update kernels).
extern "C" void step_backward(const float* __restrict__ grad_out, i64 grad_stride,
                              const i64* __restrict__ order, const i64* __restrict__ starts,
                              const i64* __restrict__ entry_bag, const float* __restrict__ scale,
                              i64 distinct, i64 dim, void* __restrict__ rows, i64 format, i64 row_width,
                              const i64* __restrict__ slots, unsigned char* __restrict__ dirty, int optimizer,
                              const float* __restrict__ params, const i64* __restrict__ slot_keys, i64 stream,
                              i64 stochastic, float* __restrict__ grad_rows) {
    const HalfRounding rounding{format, slot_keys, (u64)stream, stochastic};
    if (format == FLOAT32)
        backward(grad_out, grad_stride, order, starts, entry_bag, scale, distinct, dim, (float*)rows,
                 row_width, slots, dirty, optimizer, params, rounding, grad_rows);
    else
        backward(grad_out, grad_stride, order, starts, entry_bag, scale, distinct, dim, (u16*)rows, row_width,
                 slots, dirty, optimizer, params, rounding, grad_rows);
}

// How many of keys[0..n) are not at their slot (slot_keys[slots[i]] != keys[i]): rows a forward
// found and something moved before the backward.
extern "C" i64 step_rows_moved(const i64* __restrict__ slot_keys, const i64* __restrict__ slots,
                               const i64* __restrict__ keys, i64 n) {
    i64 moved = 0;
#pragma omp parallel for reduction(+ : moved) if (n >= PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) moved += slot_keys[slots[i]] != keys[i];
    return moved;
}

// A KeyedJaggedTensor batch checked and its features' starts laid out: lengths[F * batch] (feature
// by feature), values[count] (feature by feature). Writes feature_starts[F + 1] (feature f's
// entries from feature_starts[f]) and returns what is wrong first, its detail in *detail: 0 nothing,
// 1 lengths[*detail] is negative, 2 the lengths sum to *detail, not count (values are not read then;
// a sum past int64 reads INT64_MAX), 3 entry *detail's id is negative or not below its feature's
// bounds[f]. Each check is a branch-free pass the compiler vectorizes (an OR of what it tests); only
// a batch that fails one is searched again, an entry at a time, for the first culprit.
extern "C" i64 step_check_batch(const i64* __restrict__ values, i64 count, const i64* __restrict__ lengths,
                                i64 features, i64 batch, const i64* __restrict__ bounds,
                                i64* __restrict__ feature_starts, i64* __restrict__ detail) {
    u64 bits = 0;  // every length's bits: the sign bit if one is negative, and how large they get
    for (i64 f = 0; f < features; ++f) {  // each feature's sum as it comes, wrapping, beside them
        const i64* __restrict__ feature_lengths = lengths + f * batch;
        u64 feature_sum = 0;
        for (i64 b = 0; b < batch; ++b) {
            bits |= (u64)feature_lengths[b];
            feature_sum += (u64)feature_lengths[b];
        }
        feature_starts[f + 1] = (i64)feature_sum;
    }
    if (bits >> 63) {
        for (i64 i = 0;; ++i) {
            if (lengths[i] < 0) {
                *detail = i;
                return 1;
            }
        }
    }
    // Lengths below 2^31, fewer than 2^31 of them: a feature's sum is below 2^62, exact as summed.
    const bool exact = (bits >> 31) == 0 && batch < (1LL << 31);
    i64 sum = 0;
    feature_starts[0] = 0;
    for (i64 f = 0; f < features; ++f) {
        i64 feature_sum = feature_starts[f + 1];
        if (!exact) {
            const i64* __restrict__ feature_lengths = lengths + f * batch;
            feature_sum = 0;
            for (i64 b = 0; b < batch; ++b) {
                if (__builtin_add_overflow(feature_sum, feature_lengths[b], &feature_sum)) {
                    *detail = INT64_MAX;
                    return 2;
                }
            }
        }
        if (__builtin_add_overflow(sum, feature_sum, &sum)) {
            *detail = INT64_MAX;
            return 2;
        }
        feature_starts[f + 1] = sum;
    }
    if (sum != count) {
        *detail = sum;
        return 2;
    }
    for (i64 f = 0; f < features; ++f) {
        const u64 bound = (u64)bounds[f];  // a negative id, as unsigned, is past any bound
        u64 outside = 0;
        for (i64 e = feature_starts[f]; e < feature_starts[f + 1]; ++e) outside |= (u64)values[e] >= bound;
        if (!outside) continue;
        for (i64 e = feature_starts[f];; ++e) {
            if (values[e] < 0 || values[e] >= bounds[f]) {
                *detail = e;
                return 3;
            }
        }
    }
    return 0;
}

// A collection group's keys in its output's layout, from a KeyedJaggedTensor's values (feature by
// feature, sample by sample: feature f's entries from feature_starts[f], lengths[f * batch + b] of
// them for sample b): bag b * group_count + j holds sample b's entries of feature
// group_features[j], as keys[p] = numbers[f] | values[e] (numbers: each feature's table number,
// shifted past the id bits); bag_starts[bag] is where each bag's keys start. weights (null: none)
// follow the entries into group_weights.
extern "C" void step_group_keys(const i64* __restrict__ values, const i64* __restrict__ lengths, i64 batch,
                                const i64* __restrict__ feature_starts,
                                const i64* __restrict__ group_features, i64 group_count,
                                const i64* __restrict__ numbers, const float* __restrict__ weights,
                                i64* __restrict__ keys, i64* __restrict__ bag_starts,
                                float* __restrict__ group_weights, i64* __restrict__ cursors) {
    u64 other_lengths = 0;  // none: every bag of the group holds one id, and the layout is a transpose
    for (i64 j = 0; j < group_count; ++j) {
        const i64* __restrict__ feature_lengths = lengths + group_features[j] * batch;
        for (i64 b = 0; b < batch; ++b) other_lengths |= (u64)feature_lengths[b] ^ 1;
    }
    if (!other_lengths) {
        // Blocks of samples on the team, each writing its own samples' keys; a block's run of each
        // feature stays in L1 meanwhile.
        const i64 block = 64;
#pragma omp parallel for schedule(static) if (batch * group_count >= 8 * PARALLEL_FROM)
        for (i64 first = 0; first < batch; first += block) {
            const i64 last = first + block < batch ? first + block : batch;
            for (i64 j = 0; j < group_count; ++j) {
                const i64 f = group_features[j], number = numbers[f];
                const i64* __restrict__ source = values + feature_starts[f];
                for (i64 b = first; b < last; ++b) keys[b * group_count + j] = number | source[b];
                if (weights) {
                    const float* __restrict__ source_weights = weights + feature_starts[f];
                    for (i64 b = first; b < last; ++b) group_weights[b * group_count + j] = source_weights[b];
                }
            }
        }
        for (i64 bag = 0; bag < batch * group_count; ++bag) bag_starts[bag] = bag;
        return;
    }
    for (i64 j = 0; j < group_count; ++j) cursors[j] = feature_starts[group_features[j]];
    i64 position = 0;
    for (i64 b = 0; b < batch; ++b) {
        for (i64 j = 0; j < group_count; ++j) {
            const i64 f = group_features[j];
            const i64 length = lengths[f * batch + b], source = cursors[j], number = numbers[f];
            bag_starts[b * group_count + j] = position;
            for (i64 k = 0; k < length; ++k) keys[position + k] = number | values[source + k];
            if (weights) {
                for (i64 k = 0; k < length; ++k) group_weights[position + k] = weights[source + k];
            }
            cursors[j] = source + length;
            position += length;
        }
    }
}

// rows[i] = ids[i]'s initial row, bit for bit tierstore/initializer.py's initial_rows: weights
// uniform in [-bound, bound) from 53 hashed bits of (id, seed, column), computed in double and
// rounded once to float; optimizer state zero. seed_hash: splitmix64(seed).
static inline void initial_row(i64 id, i64 dim, i64 row_width, u64 seed_hash, double bound,
                               float* __restrict__ row) {
    const u64 draws = draws_of(id, seed_hash);
    for (i64 c = 0; c < dim; ++c) row[c] = (float)((2.0 * unit_draw(draws, c) - 1.0) * bound);
    for (i64 c = dim; c < row_width; ++c) row[c] = 0.0f;
}

// initial_row of a 16-bit row: each weight computed in double, rounded to float and then to the
// 16-bit format (as torch converts a float64 tensor); the rest (padding, float32 state) zero.
static inline void initial_row_16(i64 id, i64 dim, i64 row_width, u64 seed_hash, double bound, i64 format,
                                  u16* __restrict__ row) {
    const u64 draws = draws_of(id, seed_hash);
    for (i64 c = 0; c < dim; ++c)
        row[c] = nearest((float)((2.0 * unit_draw(draws, c) - 1.0) * bound), format);
    for (i64 c = dim; c < row_width; ++c) row[c] = 0;
}

extern "C" void step_initial_rows(const i64* __restrict__ ids, i64 n, i64 dim, i64 row_width, u64 seed_hash,
                                  double bound, float* __restrict__ rows) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) initial_row(ids[i], dim, row_width, seed_hash, bound, rows + i * row_width);
}

// The cold stores' row checks (tierstore/tiers/cold/codec.py's row_hashes, bit for bit): a row's
// bytes as little-endian 32-bit words (the last one zero-padded) summed modulo 2^32, word j times
// the odd multiplier (uint32)(mix((j + 1) * golden) | 1), then mixed with its key:
// mix(sum ^ key * golden). RowChecks holds the multipliers for rows of row_bytes bytes.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "row checks read words little-endian");

struct RowChecks {
    i64 row_bytes;
    std::vector<unsigned int> multipliers;

    explicit RowChecks(i64 bytes) : row_bytes(bytes), multipliers((bytes + 3) / 4) {
        for (size_t j = 0; j < multipliers.size(); ++j)
            multipliers[j] = (unsigned int)(mix((u64)(j + 1) * GOLDEN) | 1ULL);
    }

    u64 of(const unsigned char* __restrict__ row, i64 key) const {
        unsigned int sum = 0;
        const size_t whole = (size_t)row_bytes / 4;  // words read as they lie: a little-endian load
        for (size_t j = 0; j < whole; ++j) {
            unsigned int word;
            std::memcpy(&word, row + 4 * j, 4);
            sum += word * multipliers[j];
        }
        if (whole < multipliers.size()) {  // the last bytes, zero-padded to a word
            unsigned int word = 0;
            for (i64 b = 0; 4 * (i64)whole + b < row_bytes; ++b)
                word |= (unsigned int)row[4 * whole + b] << (8 * b);
            sum += word * multipliers[whole];
        }
        return mix((u64)sum ^ ((u64)key * GOLDEN));
    }
};

// hashes[i]: the check of the row of width bytes at raw + i * stride, with id keys[i].
extern "C" void step_row_hashes(const i64* __restrict__ keys, const unsigned char* __restrict__ raw, i64 n,
                                i64 width, i64 stride, u64* __restrict__ hashes) {
    const RowChecks checks(width);
#pragma omp parallel for schedule(static) if (n >= PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) hashes[i] = checks.of(raw + i * stride, keys[i]);
}

// The system's page size (bytes).
static inline i64 page_bytes() {
    static const i64 page = (i64)sysconf(_SC_PAGESIZE);
    return page;
}

// Ask the kernel to start reading the pages of [address, address + bytes) of a mapped file.
static inline void will_need(const void* address, i64 bytes) {
    const uintptr_t start = (uintptr_t)address & ~((uintptr_t)page_bytes() - 1);
    const uintptr_t end = (uintptr_t)address + (uintptr_t)bytes;
    madvise((void*)start, end - start, MADV_WILLNEED);
}

// Ask the kernel for the pages a batch is about to touch in mapped files whose pages are likely on
// disk (MADV_WILLNEED starts their reads and returns: the disk serves them many at a time).
// step_will_need_homes: each keys[i]'s home position in a table (both arrays);
// step_will_need_rows: rows rows[0..n) (ascending) of row_bytes each from base, their pages merged
// into runs (one call a run).
extern "C" void step_will_need_homes(const i64* __restrict__ keys, i64 n, const i64* __restrict__ table_keys,
                                     const i64* __restrict__ table_values, i64 mask) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) {
        const u64 home = mix((u64)keys[i]) & (u64)mask;
        will_need(&table_keys[home], sizeof(i64));
        will_need(&table_values[home], sizeof(i64));
    }
}

extern "C" void step_will_need_rows(const unsigned char* base, i64 row_bytes, const i64* __restrict__ rows,
                                    i64 n) {
    const i64 page = page_bytes();
    i64 run_start = -1, run_end = -1;  // byte offsets of the pages of the run being merged
    for (i64 i = 0; i < n; ++i) {
        const i64 first = rows[i] * row_bytes / page * page, end = rows[i] * row_bytes + row_bytes;
        if (run_start >= 0 && first <= run_end) {
            run_end = end > run_end ? end : run_end;
            continue;
        }
        if (run_start >= 0) will_need(base + run_start, run_end - run_start);
        run_start = first, run_end = end;
    }
    if (run_start >= 0) will_need(base + run_start, run_end - run_start);
}

// A sealed run of the mmap cold store's log index (tierstore/tiers/cold/log_index.py): the mixes of
// `length` keys (mix, a bijection) in ascending order beside their values (a record number, or
// -2 - number for a removal), in a mapped file; a filter of 64-bit words (filter_mask + 1 of them, a
// power of two) that rules out most keys the run does not hold, and a directory: the mixes whose top
// bits (the mix >> shift) are j lie at starts[j] to starts[j + 1] - 1.
struct LogRun {
    const u64* hashes;
    const i64* values;
    i64 length;
    const u64* filter;
    i64 filter_mask;
    const i64* starts;
    i64 shift;
};

// The log index's sealed runs, oldest first (a newer run's value of a key supersedes an older's), and
// the table being sealed into the next one (frozen_mask < 0: none), newer than every run.
struct LogRuns {
    const LogRun* runs;
    i64 count;
    const i64* frozen_keys;
    const i64* frozen_values;
    i64 frozen_mask;
};

// The four bits of a run's filter word that stand for a key of hash `hash` (its high bits: the word
// is chosen by the low ones).
static inline u64 filter_bits(u64 hash) {
    return (1ULL << ((hash >> 40) & 63)) | (1ULL << ((hash >> 46) & 63)) | (1ULL << ((hash >> 52) & 63)) |
           (1ULL << ((hash >> 58) & 63));
}

// A run's filter: the bits of every key of mix hashes[i] set (the filter's words zeroed by the caller).
extern "C" void step_log_filter(const u64* __restrict__ hashes, i64 n, u64* __restrict__ filter, i64 mask) {
    for (i64 i = 0; i < n; ++i) filter[hashes[i] & (u64)mask] |= filter_bits(hashes[i]);
}

// Two sealed runs' entries merged (tierstore/tiers/cold/sealed_runs.py's `merged`): older's and
// newer's mixes (each ascending, distinct) with their values, into out_hashes/out_values in ascending
// order, a mix in both taking newer's value. Returns the entries written (at most older_n + newer_n).
extern "C" i64 step_merge_runs(const u64* __restrict__ older_hashes, const i64* __restrict__ older_values,
                               i64 older_n, const u64* __restrict__ newer_hashes,
                               const i64* __restrict__ newer_values, i64 newer_n,
                               u64* __restrict__ out_hashes, i64* __restrict__ out_values) {
    i64 i = 0, j = 0, k = 0;
    while (i < older_n && j < newer_n) {
        const u64 a = older_hashes[i], b = newer_hashes[j];
        const bool from_older = a < b;
        out_hashes[k] = from_older ? a : b;
        out_values[k] = from_older ? older_values[i] : newer_values[j];
        i += a <= b;  // a mix in both: older's entry dropped
        j += b <= a;
        ++k;
    }
    for (; i < older_n; ++i, ++k) {
        out_hashes[k] = older_hashes[i];
        out_values[k] = older_values[i];
    }
    for (; j < newer_n; ++j, ++k) {
        out_hashes[k] = newer_hashes[j];
        out_values[k] = newer_values[j];
    }
    return k;
}

// Whether a run's filter leaves in the key whose mix is `hash` (its filter_bits `bits`).
static inline bool run_may_hold(const LogRun& run, u64 hash, u64 bits) {
    return (run.filter[hash & (u64)run.filter_mask] & bits) == bits;
}

// key's value in the log's index, -1 where it has none: its table (keys/values/mask < 0: none) first,
// then the table being sealed, then the sealed runs, newest first. *position: the key's position in
// the table, -1 where not there.
static inline i64 log_value(const i64* __restrict__ keys, const i64* __restrict__ values, i64 mask,
                            const LogRuns* runs, i64 key, i64* position) {
    *position = mask >= 0 ? probe(keys, mask, key) : -1;
    if (*position >= 0) return values[*position];
    if (!runs) return -1;
    if (runs->frozen_mask >= 0) {
        const i64 frozen = probe(runs->frozen_keys, runs->frozen_mask, key);
        if (frozen >= 0) return runs->frozen_values[frozen];
    }
    const u64 hash = mix((u64)key), bits = filter_bits(hash);
    for (i64 r = runs->count - 1; r >= 0; --r) {
        const LogRun& run = runs->runs[r];
        if (!run_may_hold(run, hash, bits)) continue;
        const u64 bucket = hash >> run.shift;
        for (i64 i = run.starts[bucket], end = run.starts[bucket + 1]; i < end && run.hashes[i] <= hash; ++i)
            if (run.hashes[i] == hash) return run.values[i];
    }
    return -1;
}

// Asks for what log_value reads of `key` first, all of it known from the key: its home in the table
// (mask >= 0) and in the table being sealed and, in each sealed run, its filter word and directory entry.
PREFETCHING void prefetch_log_value(const i64* __restrict__ keys, const i64* __restrict__ values, i64 mask,
                                    const LogRuns* runs, i64 key) {
    if (mask >= 0) prefetch_home(keys, values, mask, key);
    if (!runs) return;
    if (runs->frozen_mask >= 0) prefetch_home(runs->frozen_keys, runs->frozen_values, runs->frozen_mask, key);
    const u64 hash = mix((u64)key);
    for (i64 r = 0; r < runs->count; ++r) {
        const LogRun& run = runs->runs[r];
        __builtin_prefetch(&run.filter[hash & (u64)run.filter_mask]);
        __builtin_prefetch(&run.starts[hash >> run.shift]);
    }
}

// Asks for what log_value reads of `key` next (once prefetch_log_value's lines have come): in each run
// whose filter does not rule the key out, the first mixes and values of its directory's bucket.
PREFETCHING void prefetch_log_runs(const LogRuns* runs, i64 key) {
    if (!runs) return;
    const u64 hash = mix((u64)key), bits = filter_bits(hash);
    for (i64 r = 0; r < runs->count; ++r) {
        const LogRun& run = runs->runs[r];
        if (!run_may_hold(run, hash, bits)) continue;
        const i64 first = run.starts[hash >> run.shift];
        __builtin_prefetch(&run.hashes[first]);
        __builtin_prefetch(&run.values[first]);
    }
}

// Where the mmap cold store (tierstore/tiers/cold/mmap_store.py) keeps its rows: the main rows and
// their index (main_keys/main_values/main_mask; main rows at or past main_count are not committed),
// and the write-ahead log's (its index: the table log_keys/log_values/log_mask < 0: no log, and the
// sealed runs log_runs, null: none; log_count records, those from `committed` on staged since the last
// flush), each stored row stored_bytes apart: the row's row_bytes, then check_bytes of its check.
struct ColdFiles {
    const i64* main_keys;
    const i64* main_values;
    i64 main_mask;
    i64 main_count;
    const unsigned char* main_rows;
    i64* log_keys;
    i64* log_values;
    i64 log_mask;
    unsigned char* log_rows;
    i64 log_count;
    i64 committed;
    i64 stored_bytes;
    i64 row_bytes;
    i64 check_bytes;
    i64 log_prepared;   // bytes of the log's rows file whose pages are made (prepare_log_pages from here)
    i64 log_allocated;  // bytes of the log's rows file whose blocks are on disk (pages made below it)
    const LogRuns* log_runs;
};

// sources[i]: where keys[i]'s stored row lies, the log's record if the log holds one, else the main
// row; null where the store holds none (a value below zero in the log's index: the key was removed).
// advise: the main index and rows are mapped files whose pages are likely on disk, so each pass first
// asks the kernel for the pages it is about to read (MADV_WILLNEED starts their reads and returns):
// the disk serves the batch's reads many at a time instead of one page fault after another. A system
// call a page: only worth it when the pages are not in memory.
static void locate_stored_rows(const i64* __restrict__ keys, i64 n, const ColdFiles& cold, int advise,
                               const unsigned char** __restrict__ sources) {
    if (advise && cold.main_mask >= 0)
        step_will_need_homes(keys, n, cold.main_keys, cold.main_values, cold.main_mask);
    // Asking for the memory of item i + AHEAD while working on item i: the indexes' positions are
    // random in tables far larger than the caches.
#pragma omp parallel for schedule(static) if (n >= PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n) {
            if (cold.log_mask >= 0) {
                prefetch_log_value(cold.log_keys, cold.log_values, cold.log_mask, cold.log_runs,
                                   keys[i + AHEAD]);
                prefetch_log_runs(cold.log_runs, keys[i + AHEAD / 2]);
            }
            if (cold.main_mask >= 0)
                prefetch_home(cold.main_keys, cold.main_values, cold.main_mask, keys[i + AHEAD]);
        }
        const unsigned char* source = nullptr;
        bool removed = false;  // the log's last record of the key is a removal (a negative value)
        if (cold.log_mask >= 0) {
            i64 position;
            const i64 record =
                log_value(cold.log_keys, cold.log_values, cold.log_mask, cold.log_runs, keys[i], &position);
            if (record != -1) {
                removed = record < 0;
                if (!removed) source = cold.log_rows + record * cold.stored_bytes;
            }
        }
        if (!source && !removed && cold.main_mask >= 0) {
            const i64 position = probe(cold.main_keys, cold.main_mask, keys[i]);
            if (position >= 0 && cold.main_values[position] < cold.main_count)  // past it: not committed
                source = cold.main_rows + cold.main_values[position] * cold.stored_bytes;
        }
        if (source) prefetch_lines(source, cold.stored_bytes);  // the check reading it next hits the cache
        sources[i] = source;
    }
    if (advise) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_FROM)
        for (i64 i = 0; i < n; ++i)
            if (sources[i]) will_need(sources[i], cold.stored_bytes);
    }
}

// Whether the stored row at `source` (of id `key`) carries the check of its bytes.
static inline bool check_holds(const unsigned char* __restrict__ source, i64 key, const ColdFiles& cold,
                               const RowChecks& checks) {
    if (!cold.check_bytes) return true;
    const u64 check = checks.of(source, key);
    bool matches = true;
    for (i64 b = 0; b < cold.check_bytes; ++b)
        matches &= source[cold.row_bytes + b] == ((check >> (8 * b)) & 0xFF);
    return matches;
}

// The stored form of `row` (row_bytes) of id `key` at `target`: its bytes, then check_bytes of its
// check, computed from `row` (the target's memory may still be on its way).
static inline void store_row(unsigned char* __restrict__ target, const unsigned char* __restrict__ row,
                             i64 key, i64 row_bytes, i64 check_bytes, const RowChecks& checks) {
    std::memcpy(target, row, row_bytes);
    if (!check_bytes) return;
    const u64 check = checks.of(row, key);
    for (i64 b = 0; b < check_bytes; ++b) target[row_bytes + b] = (unsigned char)(check >> (8 * b));
}

// The mmap cold store's batched read: copies each keys[i]'s stored row (row_bytes) to out[i] and
// sets found[i] (rows of keys not found are left as they are); returns how many copied rows fail
// their check (0 without checks), the first of them in *first_bad. log_mask < 0: no log.
extern "C" i64 step_cold_rows(const i64* __restrict__ keys, i64 n, const i64* __restrict__ main_keys,
                              const i64* __restrict__ main_values, i64 main_mask, i64 main_count, int advise,
                              const unsigned char* __restrict__ main_rows, const i64* __restrict__ log_keys,
                              const i64* __restrict__ log_values, i64 log_mask, const LogRuns* log_runs,
                              const unsigned char* __restrict__ log_rows, i64 stored_bytes, i64 row_bytes,
                              i64 check_bytes, unsigned char* __restrict__ out,
                              unsigned char* __restrict__ found, i64* __restrict__ first_bad) {
    const ColdFiles cold{main_keys,
                         main_values,
                         main_mask,
                         main_count,
                         main_rows,
                         const_cast<i64*>(log_keys),
                         const_cast<i64*>(log_values),
                         log_mask,
                         const_cast<unsigned char*>(log_rows),
                         0,
                         0,
                         stored_bytes,
                         row_bytes,
                         check_bytes,
                         0,
                         0,
                         log_runs};
    const RowChecks checks(row_bytes);
    Room<const unsigned char*> sources(n);
    locate_stored_rows(keys, n, cold, advise, sources.data());
    i64 bad = 0, first = n;
#pragma omp parallel for schedule(static) reduction(+ : bad) reduction(min : first) if (n >= PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n && sources[i + AHEAD]) prefetch_lines(sources[i + AHEAD], cold.stored_bytes);
        const unsigned char* source = sources[i];
        found[i] = source != nullptr;
        if (!source) continue;
        std::memcpy(out + i * row_bytes, source, row_bytes);
        if (!check_holds(source, keys[i], cold, checks)) {
            bad += 1;
            first = i < first ? i : first;
        }
    }
    *first_bad = first;
    return bad;
}

// The mmap cold store's staging of rows in its write-ahead log (tierstore/tiers/cold/mmap_store.py):
// the stored form of rows[i] (row_bytes, then check_bytes of its check for id keys[i]) goes over
// keys[i]'s record in log_rows when the log's index (its table log_keys/log_values/log_mask and its
// sealed runs log_runs) has one at or past `committed` (staged since the last flush); else it is packed
// into out_new, in order, with new_keys[j] its id and superseded[j] whether the index's table has an
// entry of it (a committed record, or a removal: the caller replaces it; a sealed run's entry is
// superseded by the table's new one). Returns how many were packed.
extern "C" i64 step_cold_stage(const i64* __restrict__ keys, i64 n, const unsigned char* __restrict__ rows,
                               i64 row_bytes, i64 check_bytes, const i64* __restrict__ log_keys,
                               const i64* __restrict__ log_values, i64 log_mask, const LogRuns* log_runs,
                               i64 committed, unsigned char* __restrict__ log_rows,
                               unsigned char* __restrict__ out_new, i64* __restrict__ new_keys,
                               unsigned char* __restrict__ superseded) {
    const RowChecks checks(row_bytes);
    const i64 stored_bytes = row_bytes + check_bytes;
    // Two passes, as the read's: where each row goes (the log's index, in order: the packing), then
    // the rows and their checks, asking for the target of row i + AHEAD while writing row i.
    Room<unsigned char*> targets(n);
    i64 packed = 0;
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n) {
            prefetch_log_value(log_keys, log_values, log_mask, log_runs, keys[i + AHEAD]);
            prefetch_log_runs(log_runs, keys[i + AHEAD / 2]);
        }
        i64 position;
        const i64 record = log_value(log_keys, log_values, log_mask, log_runs, keys[i], &position);
        if (record >= committed) {
            targets[i] = log_rows + record * stored_bytes;
        } else {
            targets[i] = out_new + packed * stored_bytes;
            new_keys[packed] = keys[i];
            superseded[packed] = position >= 0;  // in the table: a committed record, or a removal
            ++packed;
        }
    }
#pragma omp parallel for schedule(static) if (n >= PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n) __builtin_prefetch(targets[i + AHEAD], 1);
        store_row(targets[i], rows + i * row_bytes, keys[i], row_bytes, check_bytes, checks);
    }
    return packed;
}

// A host cache tier's arrays (tierstore/tiers/row_cache.py): its index (int32 slots), each slot's
// key, row (row_width values of `format`: FLOAT32 or a 16-bit one), dirty and fresh flags and LFU score.
struct HostTier {
    i64* index_keys;
    int* index_values;
    i64 index_mask;
    i64* slot_keys;
    unsigned char* rows;
    i64 row_width;
    unsigned char* dirty;
    unsigned char* fresh;
    float* scores;
    i64 format;
    const i64* direct_bases;  // the tier's direct layout (DirectLayout; direct_tables 0: none)
    const i64* direct_sizes;
    i64 direct_tables;
    i64 direct_slots;
};

// How a row the cold store does not hold starts (step_initial_rows' arguments).
struct InitialRows {
    i64 dim;
    u64 seed_hash;
    double bound;
};

// A spinning thread's hint to the core that it waits (x86's pause, Arm's yield).
static inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

static inline i64 steady_ns() {
    timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (i64)now.tv_sec * 1000000000LL + (i64)now.tv_nsec;
}

// Write bytes[0..size) at `offset` of the file `fd`; 0, or the errno of the failed write.
static int write_all(int fd, const unsigned char* bytes, i64 size, i64 offset) {
    while (size > 0) {
        const ssize_t written = pwrite(fd, bytes, (size_t)size, (off_t)offset);
        if (written < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        bytes += written, size -= written, offset += written;
    }
    return 0;
}

// Zeros over bytes [first, end) of the log's rows file `fd` (whole pages past every record), so that
// their page cache pages exist before appends reach them: the kernel makes the pages (and, in a virtual
// machine, the host its memory behind them) on a thread that would wait for the log's writes, not
// inside its `pwrite`. A hint: a failed write leaves the appends to make the pages, as before.
static void prepare_log_pages(int fd, i64 first, i64 end) {
    static const unsigned char zeros[PAGE_RUN] = {};
    if (end > first) (void)!write_all(fd, zeros, end - first, first);
}

// prepare_log_pages over bytes [first, end) of `fd`, a run at a time: the log's pages made ahead of
// its appends on a thread of their own, between steps (tierstore/tiers/cold/pages_ahead.py).
extern "C" void step_prepare_pages(int fd, i64 first, i64 end) {
    for (i64 at = first; at < end; at += PAGE_RUN) prepare_log_pages(fd, at, std::min(end, at + PAGE_RUN));
}

// A host tier's misses made resident straight from the mmap cold store (step_make_resident's last
// part): keys[0..n) (distinct, none in the tier, each looked up
// counts[i] times) go to slots[0..n), of which the last `victims` hold rows the tier evicts.
// 1. Each key's stored row is located and its check verified. Rows failing it: their number is
//    returned, the first in out[4], and nothing has changed.
// 2. The victims' dirty rows are staged in the log as step_cold_stage stages them: over their record
//    where it is staged since the last flush, else appended as records log_count on, written with
//    pwrite (log_rows_fd, log_keys_fd; the caller has allocated their blocks and room in the log's
//    index). A failed write returns -errno, nothing else changed (bytes past log_count count for
//    nothing). Once the writes are done, the records rewritten in place are shared by both threads.
//    The pages of PAGES_AHEAD times the appends past them are made (prepare_log_pages), by the second
//    thread while the writes run and by both after the rewrites; out[9]: where those pages end.
// 3. Meanwhile (a second thread, from SECTIONS_FROM victims) the victims' keys leave the tier's
//    index and the keys enter it (put back as they were if a write failed); then slot slots[i]
//    takes keys[i], its stored row (or its initial row where the store holds none: then dirty and
//    fresh) and a score of counts[i] x increment, as an admission's reset and LFU's count leave it.
// out[0]: lookups of keys the store holds; out[1]: victims written back; out[2]: records appended;
// out[3]: keys new to the log's index; out[5..8]: where the time went (ns): the stored rows read
// (1), the log's side of 2 (its share of the rewrites included) and the tier's index (on their own
// threads), the slots filled (3).
static i64 step_admit_cold(const i64* __restrict__ keys, const i64* __restrict__ counts, i64 n,
                           float increment, const i64* __restrict__ slots, i64 victims,
                           const HostTier* tier_arrays, const ColdFiles* cold_files, int advise,
                           int log_rows_fd, int log_keys_fd, const InitialRows* initial,
                           i64* __restrict__ out) {
    const HostTier& tier = *tier_arrays;
    const ColdFiles& cold = *cold_files;
    const RowChecks checks(cold.row_bytes);
    const i64 started = steady_ns();
    Room<const unsigned char*> sources(n);
    locate_stored_rows(keys, n, cold, advise, sources.data());
    i64 bad = 0, first = n, held_lookups = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad, held_lookups) \
    reduction(min : first) if (n >= PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n && sources[i + AHEAD]) prefetch_lines(sources[i + AHEAD], cold.stored_bytes);
        if (!sources[i]) continue;
        held_lookups += counts[i];
        if (!check_holds(sources[i], keys[i], cold, checks)) {
            bad += 1;
            first = i < first ? i : first;
        }
    }
    out[5] = steady_ns() - started;
    if (bad) {
        out[4] = first;
        return bad;
    }

    // 2. The victims' dirty rows: where each goes (the log's index): over its record where that was
    // staged since the last flush, else appended (packed, in order, then written). 3. Meanwhile, on a
    // second thread, the tier's index: the victims' keys out, the keys in (undone if a write fails).
    // Once the writes are done, both threads take the rewrites in place, a run at a time: each
    // rewrites a record of its own (the victims' keys are distinct), so their order changes nothing.
    struct Staged {
        unsigned char* target;  // the record rewritten in place (unused where appended)
        const unsigned char* row;
        i64 key;
        i64 position;  // the key's position in the log's index (-1: new to the log)
    };
    const i64* victim_slots = slots + (n - victims);
    Room<i64> victim_keys(victims), appended_keys(victims);
    Room<Staged> rewritten(victims), appended_rows(victims);
    i64 rewrites = 0, appended = 0;      // set before the writes are released, read after
    for (i64 j = 0; j < victims; ++j) {  // asking for the memory of item j + AHEAD, as everywhere
        if (j + AHEAD < victims) __builtin_prefetch(&tier.slot_keys[victim_slots[j + AHEAD]]);
        victim_keys[j] = tier.slot_keys[victim_slots[j]];
    }
    auto store = [&](unsigned char* target, const unsigned char* row, i64 key) {
        store_row(target, row, key, cold.row_bytes, cold.check_bytes, checks);
    };
    const i64 row_bytes = row_bytes_of(tier.row_width, tier.format);
    Room<int> former(victims), slot_values(n);
    for (i64 i = 0; i < n; ++i) slot_values[i] = (int)slots[i];
    int error = 0;
    i64 new_to_log = 0;
    std::atomic<int> written{0};  // the log's writes: 0 under way, 1 done, -1 failed
    std::atomic<i64> next_rewrite{0};
    i64 ahead_first = 0, ahead_end = 0;    // the pages to make (bytes of the log's rows), set with...
    std::atomic<bool> ahead_known{false};  // ...this, once the log's side knows its appends
    std::atomic<i64> next_ahead{0};
    auto pages_ahead = [&](bool while_writing) {  // a run at a time, until none is left (or the writes end)
        for (i64 first; !(while_writing && written.load(std::memory_order_acquire)) &&
                        (first = ahead_first + next_ahead.fetch_add(PAGE_RUN)) < ahead_end;)
            prepare_log_pages(log_rows_fd, first, std::min(ahead_end, first + PAGE_RUN));
    };
    // A wait on the other thread: spinning, then giving the core away (a write the kernel holds up
    // while it throttles dirty pages, a busy machine).
    auto wait_until = [](auto ready) {
        for (i64 spins = 0; !ready(); ++spins) {
            if (spins < SPINS_BEFORE_YIELD)
                spin_pause();
            else
                sched_yield();
        }
    };
    auto rewrite_runs = [&]() {  // runs of the rewrites in place, until none is left
        for (i64 first; (first = next_rewrite.fetch_add(REWRITE_RUN)) < rewrites;) {
            const i64 last = std::min(rewrites, first + REWRITE_RUN);
            for (i64 j = first; j < last; ++j) {
                if (j + AHEAD < last) {
                    prefetch_lines(rewritten[j + AHEAD].row, cold.row_bytes);
                    prefetch_lines<1>(rewritten[j + AHEAD].target, cold.stored_bytes);
                }
                store(rewritten[j].target, rewritten[j].row, rewritten[j].key);
            }
        }
    };
#pragma omp parallel num_threads(2) if (victims >= SECTIONS_FROM)
    {
        const int thread = omp_get_thread_num(), team = omp_get_num_threads();
        if (thread == 0) {  // the log's side
            const i64 logging = steady_ns();
            for (i64 j = 0; j < victims; ++j) {
                if (j + AHEAD < victims) {
                    prefetch_log_value(cold.log_keys, cold.log_values, cold.log_mask, cold.log_runs,
                                       victim_keys[j + AHEAD]);
                    prefetch_log_runs(cold.log_runs, victim_keys[j + AHEAD / 2]);
                    __builtin_prefetch(&tier.dirty[victim_slots[j + AHEAD]]);
                }
                const i64 slot = victim_slots[j], key = victim_keys[j];
                if (!tier.dirty[slot]) continue;
                i64 position;
                const i64 record =
                    log_value(cold.log_keys, cold.log_values, cold.log_mask, cold.log_runs, key, &position);
                const bool in_place = record >= cold.committed;  // written to both lists, counted in one
                const Staged staged{cold.log_rows + (in_place ? record : 0) * cold.stored_bytes,
                                    tier.rows + slot * row_bytes, key, position};
                rewritten[rewrites] = staged;
                appended_rows[appended] = staged;
                appended_keys[appended] = key;
                rewrites += in_place;
                appended += !in_place;
            }
            const i64 page = page_bytes();
            const i64 appends_end = (cold.log_count + appended) * cold.stored_bytes;
            ahead_first = std::max(cold.log_prepared, (appends_end + page - 1) / page * page);
            ahead_end =
                std::min(cold.log_allocated, appends_end + PAGES_AHEAD * appended * cold.stored_bytes);
            ahead_end = std::max(ahead_first, ahead_end / page * page);
            ahead_known.store(true, std::memory_order_release);
            if (appended) {
                Room<unsigned char> packed(appended * cold.stored_bytes);
                for (i64 j = 0; j < appended; ++j) {
                    if (j + AHEAD < appended) prefetch_lines(appended_rows[j + AHEAD].row, cold.row_bytes);
                    store(packed.data() + j * cold.stored_bytes, appended_rows[j].row, appended_rows[j].key);
                }
                error = write_all(log_rows_fd, packed.data(), appended * cold.stored_bytes,
                                  cold.log_count * cold.stored_bytes);
                if (!error)
                    error = write_all(log_keys_fd, (const unsigned char*)appended_keys.data(),
                                      appended * (i64)sizeof(i64), cold.log_count * (i64)sizeof(i64));
            }
            written.store(error ? -1 : 1, std::memory_order_release);
            if (!error) {  // nothing fails from here on: the log's index, then rewrites in place
                for (i64 j = 0; j < appended; ++j) {
                    if (j + AHEAD < appended) {  // each key's place in the index, asked for ahead
                        const i64 ahead = appended_rows[j + AHEAD].position;
                        if (ahead >= 0)
                            __builtin_prefetch(&cold.log_values[ahead], 1);
                        else
                            prefetch_home<1>(cold.log_keys, cold.log_values, cold.log_mask,
                                             appended_keys[j + AHEAD]);
                    }
                    const i64 record = cold.log_count + j;
                    if (appended_rows[j].position >= 0) {  // its committed record is superseded
                        cold.log_values[appended_rows[j].position] = record;
                    } else {
                        int status = 0;
                        insert_serial(cold.log_keys, cold.log_values, cold.log_mask, &appended_keys[j],
                                      &record, 1, &status);
                        ++new_to_log;
                    }
                }
                rewrite_runs();
                pages_ahead(false);
            }
            out[6] = steady_ns() - logging;
        }
        if (thread == 1 || team == 1) {  // the tier's index, then rewrites once the writes are done
            const i64 indexing = steady_ns();
            erase_shifting(tier.index_keys, tier.index_values, tier.index_mask, victim_keys.data(), victims,
                           former.data());
            int status = 0;
            insert_serial(tier.index_keys, tier.index_values, tier.index_mask, keys, slot_values.data(), n,
                          &status);
            out[7] = steady_ns() - indexing;
            wait_until([&] { return ahead_known.load(std::memory_order_acquire); });
            pages_ahead(true);
            wait_until([&] { return written.load(std::memory_order_acquire) != 0; });
            if (written.load(std::memory_order_acquire) > 0) {
                rewrite_runs();
                pages_ahead(false);
            }
        }
    }
    if (error) {  // the tier's index as it was: the keys out, the victims back at their slots
        Room<int> gone(n);
        erase_shifting(tier.index_keys, tier.index_values, tier.index_mask, keys, n, gone.data());
        int status = 0;
        insert_serial(tier.index_keys, tier.index_values, tier.index_mask, victim_keys.data(), former.data(),
                      victims, &status);
        return -error;
    }
    // The slots change hands.
    const i64 filling = steady_ns();
#pragma omp parallel for schedule(static) if (n >= PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n) {  // the slot's row, key and score, and the stored row coming in
            const i64 ahead = slots[i + AHEAD];
            prefetch_lines<1>(&tier.rows[ahead * row_bytes], row_bytes);
            __builtin_prefetch(&tier.slot_keys[ahead], 1);
            __builtin_prefetch(&tier.scores[ahead], 1);
            if (sources[i + AHEAD]) prefetch_lines(sources[i + AHEAD], row_bytes);
        }
        const i64 slot = slots[i];
        unsigned char* row = tier.rows + slot * row_bytes;
        if (sources[i])
            std::memcpy(row, sources[i], row_bytes);
        else if (tier.format == FLOAT32)
            initial_row(keys[i], initial->dim, tier.row_width, initial->seed_hash, initial->bound,
                        (float*)row);
        else
            initial_row_16(keys[i], initial->dim, tier.row_width, initial->seed_hash, initial->bound,
                           tier.format, (u16*)row);
        tier.slot_keys[slot] = keys[i];
        tier.dirty[slot] = tier.fresh[slot] = sources[i] == nullptr;
        tier.scores[slot] = 0.0f;
        add_count(tier.scores, slot, counts[i], increment);
    }
    out[8] = steady_ns() - filling;
    out[0] = held_lookups;
    out[1] = appended + rewrites;
    out[2] = appended;
    out[3] = new_to_log;
    out[9] = std::max(cold.log_prepared, ahead_end);
    return 0;
}

// LFU's choice of victims in a host tier (tierstore/tiers/policies.py's LfuWithAgeing, through
// RowCache.native_choice): the tier's free slots (taken from the end of free_slots[0..free_count)),
// the pool its last scan left (slots with the scores and keys they had then), room for a new scan:
// `ranked` (victims + pool_size slots), `ranked_scores` and `ranked_keys` (pool_size each: the new
// pool's scores and keys as ranked), and what an access adds to a score now.
struct TierChoice {
    unsigned char* pins;
    i64 capacity;
    i64* free_slots;      // a stack: its top is taken first (a direct layout's homes moved up first)
    int* free_positions;  // each free slot's place in it, where the tier has a direct layout
    i64 free_count;
    const i64* pool;
    const float* pool_scores;
    const i64* pool_keys;
    i64 pool_length;
    i64 pool_size;
    i64* ranked;
    float* ranked_scores;
    i64* ranked_keys;
    float increment;
};

// What step_make_resident did. status 0: the keys are resident; 1: `bad` stored rows fail their check
// (detail: the first one's key); 2: too few slots are evictable (detail: how many are); 3: a write of
// the log failed (detail: its errno). Whatever the status: the hits' scores were raised (hit_lookups
// and missed_lookups counted) and, where victims were wanted, the pool entries they took are gone
// (pool_taken; -1: the pool ran short and a scan ranked ranked_count slots, fewer than `victims`
// with status 2). Otherwise nothing changed unless the status is 0.
struct Residency {
    i64 status, detail;
    i64 hit_lookups, missed_lookups, misses;
    i64 from_free, victims, pool_taken, ranked_count;
    i64 held_lookups, written_back, appended, new_to_log, bad;
    i64 log_prepared;                          // step_admit_cold's out[9] (the cold files' own if none ran)
    i64 find_ns, choose_ns, admit_ns;          // where the call's time went (steady clock)
    i64 distinct_ns, pooled_ns;                // step_lookup_bags' own passes before and after
    i64 read_ns, log_ns, reindex_ns, fill_ns;  // the admission's parts: step_admit_cold's out[5..8]
};

// A host tier's batch made resident in one call (tierstore/tiers/cold/mmap_store.py's
// make_resident_in): keys[0..n) (distinct, each looked up counts[i] times) are found in the tier
// (cache_resolve: the hits' scores raised), the misses take free slots (their homes where the tier
// has a direct layout and they all fit: cache_direct_claims), then victims (LFU's:
// cache_pool_take from the pool, else cache_lowest_slots ranking the pool anew), with the hits and
// protect[0..protect_count) pinned while they are chosen, and come in from the cold store
// (step_admit_cold). slots[i]: keys[i]'s slot (where status is 0).
// LFU's shadow caches' replay of a batch's distinct keys (ageing_replay's arguments; see
// step_lookup_bags), run once: beside the victims' scan where that runs on one thread, else after.
struct ShadowReplay {
    const i64* keys;
    const i64* counts;
    i64 n;
    u64 threshold;
    AgeingShadow* shadows;
    i64 shadow_count;
    double memory;
    double* hits;
    bool done;    // no replay to run (no shadows), or it ran
    i64 sampled;  // out: the lookups it sampled

    void run() {
        if (done) return;
        sampled = ageing_replay(keys, counts, n, threshold, shadows, shadow_count, memory, hits);
        done = true;
    }
};

// step_make_resident (below), running `replay` (or null) beside a one-thread scan for victims.
static void make_resident(const i64* __restrict__ keys, const i64* __restrict__ counts, i64 n,
                          const i64* __restrict__ protect, i64 protect_count, const HostTier* tier_arrays,
                          const TierChoice* tier_choice, const ColdFiles* cold_files, int advise,
                          int log_rows_fd, int log_keys_fd, const InitialRows* initial,
                          i64* __restrict__ slots, Residency* out, ShadowReplay* replay,
                          const FoundSlots* found_slots) {
    const HostTier& tier = *tier_arrays;
    const TierChoice& choice = *tier_choice;
    const float increment = choice.increment;
    *out = Residency{};
    out->pool_taken = -1;
    out->log_prepared = cold_files->log_prepared;
    const i64 started = steady_ns();
    Room<i64> hit_slots(n), missed(n);
    i64 lookups[2];
    // Where the keys outnumber the free slots, victims may be wanted: the hits are pinned as they are
    // found (none may be one), and unpinned once the victims are chosen.
    unsigned char* const hit_pins = n > choice.free_count ? choice.pins : nullptr;
    const DirectLayout layout{tier.direct_bases, tier.direct_sizes, tier.direct_tables, tier.direct_slots};
    const i64 misses = resolve_keys(tier.index_keys, tier.index_values, tier.index_mask, tier.slot_keys,
                                    layout, keys, counts, n, tier.scores, increment, hit_pins, slots,
                                    hit_slots.data(), missed.data(), lookups, found_slots);
    const i64 hits = n - misses;
    out->hit_lookups = lookups[0];
    out->missed_lookups = lookups[1];
    out->misses = misses;
    const i64 found = steady_ns();
    out->find_ns = found - started;
    if (misses == 0) {
        if (hit_pins) cache_pins_add(choice.pins, hit_slots.data(), hits, -1);
        return;
    }

    Room<i64> claimed(misses), missed_keys(misses), missed_counts(misses);
    for (i64 i = 0; i < misses; ++i) {
        missed_keys[i] = keys[missed[i]];
        missed_counts[i] = counts[missed[i]];
    }
    const i64 from_free = std::min(misses, choice.free_count);
    if (tier.direct_tables && misses <= choice.free_count)  // the misses with a free home take it
        cache_direct_claims(choice.free_slots, choice.free_positions, choice.free_count, tier.direct_bases,
                            tier.direct_sizes, tier.direct_tables, tier.direct_slots, missed_keys.data(),
                            misses, claimed.data());
    else
        for (i64 i = 0; i < from_free; ++i) claimed[i] = choice.free_slots[choice.free_count - from_free + i];
    const i64 victims = misses - from_free;
    out->from_free = from_free;
    out->victims = victims;
    if (victims) {
        cache_pins_add(choice.pins, protect, protect_count, 1);
        i64* const taken = &claimed[from_free];
        auto choose = [&]() {
            out->pool_taken =
                cache_pool_take(choice.pool, choice.pool_scores, choice.pool_keys, choice.pool_length,
                                tier.scores, tier.slot_keys, choice.pins, victims, taken);
            if (out->pool_taken >= 0) return;
            // LFU's scan ranks a pool past the victims (LfuWithAgeing.victims: none where the victims
            // outnumber the pool, which would serve no step like this one).
            const i64 pool = victims <= choice.pool_size ? choice.pool_size : 0;
            const i64 ranked = cache_lowest_slots(tier.scores, tier.slot_keys, choice.pins, choice.capacity,
                                                  victims + pool, victims, choice.ranked);
            out->ranked_count = ranked;
            if (ranked >= victims) {
                std::memcpy(taken, choice.ranked, victims * sizeof(i64));
                for (i64 j = victims; j < ranked; ++j) {
                    choice.ranked_scores[j - victims] = tier.scores[choice.ranked[j]];
                    choice.ranked_keys[j - victims] = tier.slot_keys[choice.ranked[j]];
                }
            }
        };
        // Where the pool cannot serve the victims (a scan is certain) and the scan runs on one thread,
        // the shadow caches' replay takes the second (the two touch nothing in common).
        const bool beside =
            replay && !replay->done && victims > choice.pool_length && scan_on_one_thread(choice.capacity);
        if (beside) {
#pragma omp parallel num_threads(2)
            {
                const int thread = omp_get_thread_num(), team = omp_get_num_threads();
                if (thread == 0) choose();
                if (thread == 1 || team == 1) replay->run();
            }
        } else {
            choose();  // outside any region: a larger tier's scan has the team to itself
        }
        cache_pins_add(choice.pins, protect, protect_count, -1);  // uint8 counts: undone exactly
    }
    if (hit_pins) cache_pins_add(choice.pins, hit_slots.data(), hits, -1);
    if (victims && out->pool_taken < 0 && out->ranked_count < victims) {
        out->status = 2;
        out->detail = out->ranked_count;
        return;
    }
    const i64 chosen = steady_ns();
    out->choose_ns = chosen - found;

    i64 admitted[10] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    const i64 result =
        step_admit_cold(missed_keys.data(), missed_counts.data(), misses, increment, claimed.data(), victims,
                        tier_arrays, cold_files, advise, log_rows_fd, log_keys_fd, initial, admitted);
    out->admit_ns = steady_ns() - chosen;
    out->read_ns = admitted[5];
    out->log_ns = admitted[6];
    out->reindex_ns = admitted[7];
    out->fill_ns = admitted[8];
    if (result > 0) {
        out->status = 1;
        out->bad = result;
        out->detail = missed_keys[admitted[4]];
        return;
    }
    if (result < 0) {
        out->status = 3;
        out->detail = -result;
        return;
    }
    for (i64 i = 0; i < misses; ++i) slots[missed[i]] = claimed[i];
    out->held_lookups = admitted[0];
    out->written_back = admitted[1];
    out->appended = admitted[2];
    out->new_to_log = admitted[3];
    out->log_prepared = admitted[9];
}

extern "C" void step_make_resident(const i64* __restrict__ keys, const i64* __restrict__ counts, i64 n,
                                   const i64* __restrict__ protect, i64 protect_count,
                                   const HostTier* tier_arrays, const TierChoice* tier_choice,
                                   const ColdFiles* cold_files, int advise, int log_rows_fd, int log_keys_fd,
                                   const InitialRows* initial, i64* __restrict__ slots, Residency* out) {
    make_resident(keys, counts, n, protect, protect_count, tier_arrays, tier_choice, cold_files, advise,
                  log_rows_fd, log_keys_fd, initial, slots, out, nullptr, nullptr);
}

// A training lookup of bags in one call (tierstore/tiers/cold/mmap_store.py's lookup_bags_in, for
// tierstore/nn/native_step.py): the batch's distinct ids (step_distinct, into `distinct`: unique,
// counts, entry rows, order, starts, each `entries` long but the last), refused where they outnumber
// the tier's rows (status 4, detail: how many; nothing changed), the sampled ones replayed through
// LFU's shadow caches (ageing_replay; no replay where shadows is null), made resident as
// step_make_resident makes them (slots[0..U)) and, once they are, every bag pooled straight from the
// tier's rows (step_pooled_forward). The out fields are step_make_resident's.
struct BagLookup {
    const i64* ids;
    i64 entries;
    i64 padding;  // entries holding it are left out, where has_padding
    int has_padding;
    int* scratch;  // step_distinct_scratch(entries) ints
    i64* distinct;
    i64 max_rows;
    u64 threshold;  // ageing_replay's arguments
    AgeingShadow* shadows;
    i64 shadow_count;
    double memory;
    double* hits;
    const i64* offsets;  // the bags and the pooled output, as step_pooled_forward takes them
    i64 bag_length;
    i64 last_end;
    i64 bags;
    int mean;
    const float* weights;
    float* out;
    i64 dim;
    i64* entry_bag;
    float* scale;
    i64 distinct_count;  // out: U
    i64 sampled;         // out: the lookups the replay sampled
    i64 own_bags;        // out: step_pooled_forward's result (1: entry_bag and scale not written)
};

// entry_slots[e]: the slot of ids[e] (a key, repeats and padding included) in `tier`, or -1.
static void find_entry_slots(const HostTier* tier, const i64* __restrict__ ids, i64 n,
                             i64* __restrict__ entry_slots) {
    const DirectLayout layout{tier->direct_bases, tier->direct_sizes, tier->direct_tables,
                              tier->direct_slots};
    slots_of(tier->index_keys, tier->index_values, tier->index_mask, tier->slot_keys, layout, ids, 0, n,
             entry_slots);
}

extern "C" void step_lookup_bags(BagLookup* lookup, const HostTier* tier, const TierChoice* choice,
                                 const ColdFiles* cold, int advise, int log_rows_fd, int log_keys_fd,
                                 const InitialRows* initial, i64* __restrict__ slots, Residency* out) {
    BagLookup& bags = *lookup;
    const i64 started = steady_ns();
    const i64 n = bags.entries;
    i64 *const unique = bags.distinct, *const counts = unique + n, *const entry_rows = unique + 2 * n;
    i64 *const order = unique + 3 * n, *const starts = unique + 4 * n;
    // A batch deduplicated on one thread has the other find each entry's slot in the tier meanwhile
    // (entries = the keys and their repeats; the tier does not change until make_resident).
    const bool probe_beside = n >= PARALLEL_FROM && distinct_on_one_thread(n);
    Room<i64> entry_slots(probe_beside ? n : 0);
    auto deduplicate = [&]() {
        return step_distinct(bags.ids, n, bags.padding, bags.has_padding, bags.scratch, unique, counts,
                             entry_rows, starts, order);
    };
    i64 count = 0;
    if (probe_beside) {
#pragma omp parallel num_threads(2)
        {
            const int thread = omp_get_thread_num(), team = omp_get_num_threads();
            if (thread == 0) count = deduplicate();
            if (thread == 1 || team == 1) find_entry_slots(tier, bags.ids, n, entry_slots.data());
        }
    } else {
        count = deduplicate();  // outside any region: a large batch's dedupe has the team to itself
    }
    const FoundSlots found{entry_slots.data(), order, starts};
    bags.distinct_count = count;
    bags.sampled = 0;
    if (count > bags.max_rows) {
        *out = Residency{};
        out->status = 4;
        out->detail = count;
        return;
    }
    ShadowReplay replay{
        unique,    counts,        count, bags.threshold, bags.shadows, bags.shadow_count, bags.memory,
        bags.hits, !bags.shadows, 0};
    const i64 deduplicated = steady_ns();
    make_resident(unique, counts, count, nullptr, 0, tier, choice, cold, advise, log_rows_fd, log_keys_fd,
                  initial, slots, out, &replay, probe_beside ? &found : nullptr);
    const i64 replaying = steady_ns();
    replay.run();  // where it had no thread beside the victims' scan
    bags.sampled = replay.sampled;
    out->distinct_ns = deduplicated - started + steady_ns() - replaying;
    if (out->status != 0) return;
    const i64 resident = steady_ns();
    bags.own_bags = step_pooled_forward(tier->rows, tier->format, tier->row_width, bags.dim, slots,
                                        entry_rows, bags.has_padding ? count : -1, bags.offsets,
                                        bags.bag_length, bags.last_end, bags.bags, n, bags.mean, bags.weights,
                                        bags.out, bags.dim, bags.entry_bag, bags.scale);
    out->pooled_ns = steady_ns() - resident;
}
