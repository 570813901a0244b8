// A CPU training step's own passes, built with the kernels into the host tier's library (the
// OpenMP build of tierstore/kernels/host.py; called from tierstore/nn/native_step.py):
// - step_distinct: a batch's distinct ids by hashing (first appearance order), each entry's
//   distinct row, and the entries grouped by row (a counting sort: ascending entries in a row);
// - step_pooled_forward: every bag's pooled sum or mean, read straight from the host tier's rows;
// - step_backward: each distinct row's gradient summed from its entries and the fused optimizer
//   applied to the row in place, in one pass (or the sums written out, to be applied elsewhere).
// Results do not depend on the thread count: one thread sums each bag and each row, in entry order.

#include <vector>

#include "embedding_cache.cu"

#define PARALLEL_FROM 1024  // items: fewer run on the calling thread (waking a team costs more)

// Distinct ids of ids[0..n) leaving out entries equal to `padding` (when has_padding): unique[U] in
// first-appearance order and counts[U]; entry_rows[e] is entry e's distinct row (U for padding
// entries); starts[U + 1] (U + 2 with padding: the padding row has no entries) and order[M]: the
// non-padding entries, row by row, ascending within a row. `table_keys`/`table_rows` are scratch
// of mask + 1 >= 2n positions. Returns U.
extern "C" i64 step_distinct(const i64* __restrict__ ids, i64 n, i64 padding, int has_padding,
                             i64* __restrict__ table_keys, i64* __restrict__ table_rows, i64 mask,
                             i64* __restrict__ unique, i64* __restrict__ counts, i64* __restrict__ entry_rows,
                             i64* __restrict__ starts, i64* __restrict__ order) {
    for (i64 p = 0; p <= mask; ++p) table_keys[p] = EMPTY_KEY;
    i64 distinct = 0;
    for (i64 e = 0; e < n; ++e) {
        if (e + AHEAD < n) __builtin_prefetch(&table_keys[mix((u64)ids[e + AHEAD]) & (u64)mask]);
        const i64 key = ids[e];
        if (has_padding && key == padding) {
            entry_rows[e] = -1;
            continue;
        }
        u64 position = mix((u64)key) & (u64)mask;
        while (table_keys[position] != key && table_keys[position] != EMPTY_KEY) {
            position = (position + 1) & (u64)mask;
        }
        if (table_keys[position] == EMPTY_KEY) {
            table_keys[position] = key;
            table_rows[position] = distinct;
            unique[distinct] = key;
            counts[distinct] = 0;
            ++distinct;
        }
        const i64 row = table_rows[position];
        counts[row] += 1;
        entry_rows[e] = row;
    }
    starts[0] = 0;
    for (i64 r = 0; r < distinct; ++r) starts[r + 1] = starts[r] + counts[r];
    i64* __restrict__ next = table_rows;  // the table is done with: each row's next place in order
    for (i64 r = 0; r < distinct; ++r) next[r] = starts[r];
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

// out[b, :dim] (bag b's output at out + b * out_stride) = the sum, or the mean (`mean`), of its
// entries' rows rows[slots[entry_rows[e]], :dim], each times weights[e] when weights is not null;
// entries reading `padding_row` are left out (an empty bag pools to zeros). Bag b holds entries
// offsets[b] .. offsets[b + 1] - 1, the last bag up to last_end - 1; without offsets (null), bag b
// holds entries b * bag_length .. (b + 1) * bag_length - 1. Writes each entry's bag (-1: in none)
// and its gradient scale (its weight, 1 / the bag's entries for a mean, 1; 0 for padding).
extern "C" void step_pooled_forward(const float* __restrict__ rows, i64 row_width, i64 dim,
                                    const int* __restrict__ slots, const i64* __restrict__ entry_rows,
                                    i64 padding_row, const i64* __restrict__ offsets, i64 bag_length,
                                    i64 last_end, i64 bags, i64 entries, int mean,
                                    const float* __restrict__ weights, float* __restrict__ out,
                                    i64 out_stride, i64* __restrict__ entry_bag, float* __restrict__ scale) {
#pragma omp parallel for schedule(static) if (bags >= PARALLEL_FROM)
    for (i64 b = 0; b < bags; ++b) {
        const i64 start = offsets ? offsets[b] : b * bag_length;
        const i64 end = offsets ? (b + 1 < bags ? offsets[b + 1] : last_end) : start + bag_length;
        const i64 ahead = start + AHEAD;  // bags lie in entry order: an entry a few bags on
        if (ahead < entries && entry_rows[ahead] != padding_row) {
            __builtin_prefetch(rows + (i64)slots[entry_rows[ahead]] * row_width);
        }
        float* __restrict__ target = out + b * out_stride;
        for (i64 c = 0; c < dim; ++c) target[c] = 0.0f;
        i64 kept = 0;
        for (i64 e = start; e < end; ++e) {
            entry_bag[e] = b;
            const i64 row = entry_rows[e];
            if (row == padding_row) {
                scale[e] = 0.0f;
                continue;
            }
            const float* __restrict__ source = rows + (i64)slots[row] * row_width;
            if (weights) {
                const float weight = weights[e];
                scale[e] = weight;
                for (i64 c = 0; c < dim; ++c) target[c] += weight * source[c];
            } else {
                scale[e] = 1.0f;
                for (i64 c = 0; c < dim; ++c) target[c] += source[c];
            }
            ++kept;
        }
        if (mean && kept > 0) {
            const float share = 1.0f / (float)kept;
            for (i64 c = 0; c < dim; ++c) target[c] /= (float)kept;
            for (i64 e = start; e < end; ++e) scale[e] = scale[e] == 0.0f ? 0.0f : share;
        }
    }
    for (i64 e = last_end; e < entries; ++e) {  // past the last bag (include_last_offset)
        entry_bag[e] = -1;
        scale[e] = 0.0f;
    }
}

// The optimizers of embedding_cache.cu, by number (tierstore/nn/native_step.py's OPTIMIZERS), on one
// row with its summed gradient g; params as the optimizer's kernel takes its float arguments.
__device__ __forceinline__ void update_row(float* __restrict__ row, const float* __restrict__ g, i64 dim,
                                           int optimizer, const float* __restrict__ params) {
    switch (optimizer) {
        case 0:
            step_row(row, g, dim, SgdStep{params[0]});
            break;
        case 1:
            step_row(row, g, dim, AdagradStep{params[0], params[1]});
            break;
        case 2:
            step_row(row, g, dim, AdamStep{params[0], params[1], params[2], params[3], params[4], params[5]});
            break;
        default: {  // row-wise Adagrad, as update_rowwise_adagrad
            float sum = 0.0f;
            for (i64 c = 0; c < dim; ++c) sum += g[c] * g[c];
            const float momentum = row[dim] + sum / (float)dim;
            row[dim] = momentum;
            const float step_scale = params[0] / (sqrtf(momentum) + params[1]);
            for (i64 c = 0; c < dim; ++c) row[c] -= step_scale * g[c];
        }
    }
}

// Row r's gradient: the sum over its entries (order[starts[r]] .. order[starts[r + 1] - 1], in
// that order) of scale[e] * grad_out[entry_bag[e]] (bag b's gradient at grad_out + b * grad_stride;
// entries in no bag are left out), as bag_weight_gradient sums it. With grad_rows (not null) the
// sums are written there ([distinct, dim]); otherwise `optimizer` updates rows[slots[r]] in place
// and marks the slot dirty.
extern "C" void step_backward(const float* __restrict__ grad_out, i64 grad_stride,
                              const i64* __restrict__ order, const i64* __restrict__ starts,
                              const i64* __restrict__ entry_bag, const float* __restrict__ scale,
                              i64 distinct, i64 dim, float* __restrict__ rows, i64 row_width,
                              const int* __restrict__ slots, unsigned char* __restrict__ dirty, int optimizer,
                              const float* __restrict__ params, float* __restrict__ grad_rows) {
#pragma omp parallel if (distinct >= PARALLEL_FROM)
    {
        std::vector<float> buffer(grad_rows ? 0 : dim);
#pragma omp for schedule(dynamic, 256)
        for (i64 r = 0; r < distinct; ++r) {
            const i64 entries = starts[distinct];
            const i64 ahead = starts[r + 1] + AHEAD < entries ? starts[r + 1] + AHEAD : entries;
            for (i64 e = starts[r] + AHEAD < entries ? starts[r] + AHEAD : entries; e < ahead; ++e) {
                if (entry_bag[order[e]] >= 0)
                    __builtin_prefetch(grad_out + entry_bag[order[e]] * grad_stride);
            }
            if (!grad_rows && r + AHEAD / 4 < distinct) {
                __builtin_prefetch(rows + (i64)slots[r + AHEAD / 4] * row_width);
            }
            float* __restrict__ g = grad_rows ? grad_rows + r * dim : buffer.data();
            for (i64 c = 0; c < dim; ++c) g[c] = 0.0f;
            for (i64 e = starts[r]; e < starts[r + 1]; ++e) {
                const i64 entry = order[e];
                const i64 bag = entry_bag[entry];
                if (bag < 0) continue;
                const float* __restrict__ source = grad_out + bag * grad_stride;
                const float weight = scale[entry];
                for (i64 c = 0; c < dim; ++c) g[c] += weight * source[c];
            }
            if (!grad_rows) {
                update_row(rows + (i64)slots[r] * row_width, g, dim, optimizer, params);
                dirty[slots[r]] = 1;
            }
        }
    }
}

// How many of keys[0..n) are not at their slot (slot_keys[slots[i]] != keys[i]): rows a forward
// found and something moved before the backward.
extern "C" i64 step_rows_moved(const i64* __restrict__ slot_keys, const int* __restrict__ slots,
                               const i64* __restrict__ keys, i64 n) {
    i64 moved = 0;
#pragma omp parallel for reduction(+ : moved) if (n >= PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) moved += slot_keys[slots[i]] != keys[i];
    return moved;
}
