// A host cache tier's movement of rows as a few calls (tierstore/tiers/row_cache.py through
// tierstore/kernels/cache_passes.py; included by host_step.cpp into the tuned host build):
// - table erase by backward shifting: linear probing keeps no tombstones, so the index of a tier
//   that evicts every step never fills with them (and is never rebuilt for them); and inserts on
//   one thread (a batch of a few thousand keys costs less than waking the team); a small table's
//   probes compare four keys at once (first_stop);
// - a batch's keys resolved: slots found, hits touched, misses listed; pins and scores set per slot;
// - a direct layout's homes: where a tier gives the rows of some tables a slot each (their home),
//   a key found at its home is found without the index, and misses are placed at their homes;
// - the lowest-scoring evictable slots, ranked (LFU's scan), and the pool it leaves, served;
// - the rows of slots being evicted, and an admission's writes to its slots.
// The erase runs on one thread (it moves entries); the row copies on the OpenMP team.

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

// Ask for the memory of `key`'s home position in a table (keys and values are separate arrays: both
// at once, one memory wait instead of two, since a key mostly sits at its home). Write: for an insert.
template <int Write = 0, typename Value>
PREFETCHING void prefetch_home(const i64* __restrict__ table_keys, const Value* __restrict__ table_values,
                               i64 mask, i64 key) {
    const u64 home = mix((u64)key) & (u64)mask;
    __builtin_prefetch(&table_keys[home], Write);
    __builtin_prefetch(&table_values[home], Write);
}

// Positions of a table whose keys fit in a core's own (L2) cache: see first_stop.
static i64 cache_resident_positions() {
    long bytes = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE
    bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return (bytes > 0 ? bytes : 256 * 1024) / (i64)sizeof(i64);
}
static const i64 CACHE_RESIDENT_POSITIONS = cache_resident_positions();

// CACHE_RESIDENT_POSITIONS, for the tier's index sizing (tierstore/tiers/backends.py: a table this
// small is kept sparser, where its probes and erases run in the core's cache).
extern "C" i64 cache_window_positions() { return CACHE_RESIDENT_POSITIONS; }

// The first position from `position` on (wrapping round) that holds `key` or is empty, or -1 where
// the table has neither; tombstones are passed over. With 256-bit vectors, in a table whose keys fit
// in a core's own cache (a small tier's index, which its tier's work keeps there), the four positions
// from `position` on are compared at once: below the load limit a probe nearly always ends among
// them, and then no branch depends on where (a branch per position mispredicts about half the time).
// In a larger table the four may straddle two cache lines, and waiting on the second costs more.
static inline i64 first_stop(const i64* __restrict__ table_keys, i64 mask, i64 key, u64 position) {
#ifdef __AVX2__
    if (mask < CACHE_RESIDENT_POSITIONS && position + 4 <= (u64)mask + 1) {
        const __m256i four = _mm256_loadu_si256((const __m256i*)&table_keys[position]);
        const __m256i stop = _mm256_or_si256(_mm256_cmpeq_epi64(four, _mm256_set1_epi64x(key)),
                                             _mm256_cmpeq_epi64(four, _mm256_set1_epi64x(EMPTY_KEY)));
        const unsigned stops = (unsigned)_mm256_movemask_pd(_mm256_castsi256_pd(stop));
        if (stops) return (i64)position + __builtin_ctz(stops);
        position = (position + 4) & (u64)mask;
    }
#endif
    for (i64 probes = 0; probes <= mask; ++probes) {
        const i64 stored = table_keys[position];
        if (stored == key || stored == EMPTY_KEY) return (i64)position;
        position = (position + 1) & (u64)mask;
    }
    return -1;
}

// probe's answer (the key's position, or -1) by first_stop.
static inline i64 probe_by_four(const i64* __restrict__ table_keys, i64 mask, i64 key) {
    const i64 position = first_stop(table_keys, mask, key, mix((u64)key) & (u64)mask);
    return position >= 0 && table_keys[position] == key ? position : -1;
}

// Remove keys[0..n) (distinct) from a table that holds no tombstones, moving each removed key's
// followers back so that every key stays reachable from its home without crossing an empty
// position (Knuth's algorithm R). out_values[i]: the value keys[i] held, or -1 where absent.
// Returns how many keys were present.
template <typename Value>
static i64 erase_shifting(i64* __restrict__ table_keys, Value* __restrict__ table_values, i64 mask,
                          const i64* __restrict__ keys, i64 n, Value* __restrict__ out_values) {
    i64 present = 0;
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n) prefetch_home(table_keys, table_values, mask, keys[i + AHEAD]);
        const i64 found = probe_by_four(table_keys, mask, keys[i]);
        out_values[i] = found < 0 ? (Value)-1 : table_values[found];
        if (found < 0) continue;
        ++present;
        u64 hole = (u64)found;
        // A table below its load limit has an empty position; stopping on coming round to the
        // start keeps a full one from looping for ever.
        for (u64 next = (hole + 1) & (u64)mask; next != (u64)found; next = (next + 1) & (u64)mask) {
            const i64 stored = table_keys[next];
            if (stored == EMPTY_KEY) break;
            const u64 home = mix((u64)stored) & (u64)mask;
            // The entry at `next` may fill the hole unless its home lies in (hole, next].
            if (((next - home) & (u64)mask) >= ((next - hole) & (u64)mask)) {
                table_keys[hole] = stored;
                table_values[hole] = table_values[next];
                hole = next;
            }
        }
        table_keys[hole] = EMPTY_KEY;
    }
    return present;
}

// Insert keys[i] -> values[i] (distinct, absent) on one thread, each claiming the first empty
// position from its home (as the insert kernel does, without its compare-and-swap). Returns -1, or
// the first key that could not go in, its reason (ALREADY_PRESENT, TABLE_FULL) in *status; the
// keys before it are in.
template <typename Value>
static i64 insert_serial(i64* __restrict__ table_keys, Value* __restrict__ table_values, i64 mask,
                         const i64* __restrict__ keys, const Value* __restrict__ values, i64 n,
                         int* __restrict__ status) {
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n) prefetch_home<1>(table_keys, table_values, mask, keys[i + AHEAD]);
        const i64 position = first_stop(table_keys, mask, keys[i], mix((u64)keys[i]) & (u64)mask);
        if (position < 0 || table_keys[position] != EMPTY_KEY) {
            *status = position < 0 ? TABLE_FULL : ALREADY_PRESENT;
            return i;
        }
        table_keys[position] = keys[i];
        table_values[position] = values[i];
    }
    return -1;
}

extern "C" i64 cache_insert_serial(i64* __restrict__ table_keys, int* __restrict__ table_values, i64 mask,
                                   const i64* __restrict__ keys, const int* __restrict__ values, i64 n,
                                   int* __restrict__ status) {
    return insert_serial(table_keys, table_values, mask, keys, values, n, status);
}

extern "C" i64 index_insert_serial(i64* __restrict__ table_keys, i64* __restrict__ table_values, i64 mask,
                                   const i64* __restrict__ keys, const i64* __restrict__ values, i64 n,
                                   int* __restrict__ status) {
    return insert_serial(table_keys, table_values, mask, keys, values, n, status);
}

extern "C" i64 cache_erase_shifting(i64* __restrict__ table_keys, int* __restrict__ table_values, i64 mask,
                                    const i64* __restrict__ keys, i64 n, int* __restrict__ out_values) {
    return erase_shifting(table_keys, table_values, mask, keys, n, out_values);
}

extern "C" i64 index_erase_shifting(i64* __restrict__ table_keys, i64* __restrict__ table_values, i64 mask,
                                    const i64* __restrict__ keys, i64 n, i64* __restrict__ out_values) {
    return erase_shifting(table_keys, table_values, mask, keys, n, out_values);
}

// A tier's direct layout (tierstore/tiers/direct_layout.py): the key `number << 47 | id` of a table
// with sizes[number] > id has the home slot bases[number] + id, where that is below `slots` (the
// tier's slots now: a tier that grows has the rest later); other keys have none. tables 0: no
// layout. A key is at its home exactly when the home's slot_keys entry holds it, so the index stays
// the truth for every key and a home is only ever a shortcut to it.
struct DirectLayout {
    const i64* bases;
    const i64* sizes;
    i64 tables;
    i64 slots;
};

#define DIRECT_ID_BITS 47

static inline i64 home_slot(const DirectLayout& layout, i64 key) {
    const u64 number = (u64)key >> DIRECT_ID_BITS;  // a negative key's is past every table
    if (number >= (u64)layout.tables) return -1;
    const i64 id = key & ((1LL << DIRECT_ID_BITS) - 1);
    const i64 home = layout.bases[number] + id;
    return id < layout.sizes[number] && home < layout.slots ? home : -1;
}

// keys[i]'s slot through its home where the key is there, else through the index; -1: absent.
static inline i64 slot_of(const i64* __restrict__ table_keys, const int* __restrict__ table_values, i64 mask,
                          const i64* __restrict__ slot_keys, const DirectLayout& layout, i64 key) {
    const i64 home = layout.tables ? home_slot(layout, key) : -1;
    if (home >= 0 && slot_keys[home] == key) return home;
    const i64 position = probe_by_four(table_keys, mask, key);
    return position < 0 ? -1 : (i64)table_values[position];
}

// Ask for the memory slot_of reads first for `key`: its home's key, else its index home.
PREFETCHING void prefetch_slot_of(const i64* __restrict__ table_keys, const int* __restrict__ table_values,
                                  i64 mask, const i64* __restrict__ slot_keys, const DirectLayout& layout,
                                  i64 key) {
    const i64 home = layout.tables ? home_slot(layout, key) : -1;
    if (home >= 0)
        __builtin_prefetch(&slot_keys[home]);
    else
        prefetch_home(table_keys, table_values, mask, key);
}

// slots[i] = slot_of(keys[i]) for i in [first, last), each key's memory asked for AHEAD keys before.
static inline void slots_of(const i64* __restrict__ table_keys, const int* __restrict__ table_values,
                            i64 mask, const i64* __restrict__ slot_keys, const DirectLayout& layout,
                            const i64* __restrict__ keys, i64 first, i64 last, i64* __restrict__ slots) {
    for (i64 i = first; i < last; ++i) {
        if (i + AHEAD < last)
            prefetch_slot_of(table_keys, table_values, mask, slot_keys, layout, keys[i + AHEAD]);
        slots[i] = slot_of(table_keys, table_values, mask, slot_keys, layout, keys[i]);
    }
}

// Slots for keys[0..n) (distinct, none in the tier; n <= free_count) from the free-slot stack
// stack[0..free_count): each key whose home is free takes it (moved to the stack's top, positions[s]
// following every slot s moved: stack[positions[s]] == s while s is free, which is how a home is
// known to be free), the others the slots below them, so that out[0..n) is the stack's top n slots.
extern "C" void cache_direct_claims(i64* __restrict__ stack, int* __restrict__ positions, i64 free_count,
                                    const i64* __restrict__ bases, const i64* __restrict__ sizes, i64 tables,
                                    i64 slots, const i64* __restrict__ keys, i64 n, i64* __restrict__ out) {
    const DirectLayout layout{bases, sizes, tables, slots};
    i64 top = free_count;
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n) {
            const i64 ahead = home_slot(layout, keys[i + AHEAD]);
            if (ahead >= 0) __builtin_prefetch(&positions[ahead], 1);
        }
        const i64 home = home_slot(layout, keys[i]);
        out[i] = -1;
        if (home < 0) continue;
        const i64 at = positions[home];
        if (at < 0 || at >= top || stack[at] != home) continue;  // not in the stack's free part
        --top;
        const i64 displaced = stack[top];
        stack[at] = displaced;
        positions[displaced] = (int)at;
        stack[top] = home;
        positions[home] = (int)top;
        out[i] = home;
    }
    for (i64 i = 0; i < n; ++i)
        if (out[i] < 0) out[i] = stack[--top];
}

// A batch's slots already found entry by entry (entry_slots[e]: entry e's key's slot or -1, as
// slot_of finds it), its distinct keys' entries grouped by key (key i's first entry is
// order[starts[i]]): resolve_keys then takes each key's slot from its first entry instead of probing.
struct FoundSlots {
    const i64* entry_slots;
    const i64* order;
    const i64* starts;
    i64 of(i64 i) const { return entry_slots[order[starts[i]]]; }
};

// A batch's distinct keys[0..n) (each looked up counts[i] times) resolved in a tier: slots[i] is the
// key's slot or -1, found at its home where it is there (the layout of bases/sizes/tables/tier_slots
// over slot_keys: see slot_of), else through the index. Hits are touched as LFU counts an access
// (scores[slot] += counts[i] x increment, in float as the touch kernel's weights are) and their slots listed
// in hit_slots; the misses' positions are listed in missed. lookups[0] / lookups[1]: the hits' / misses'
// counts summed. Returns the number of misses. Here the product is rounded before the sum (no fused
// multiply-add), as the touch kernel's weights are computed apart. resolve_keys also pins the hits
// (pins[slot] += 1, in the pass that adds their counts) where pins is not null.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static inline void add_count(float* __restrict__ scores, i64 slot, i64 count, float increment) {
    scores[slot] += (float)count * increment;
}

static i64 resolve_keys(const i64* __restrict__ table_keys, const int* __restrict__ table_values, i64 mask,
                        const i64* __restrict__ slot_keys, const DirectLayout& layout,
                        const i64* __restrict__ keys, const i64* __restrict__ counts, i64 n,
                        float* __restrict__ scores, float increment, unsigned char* __restrict__ pins,
                        i64* __restrict__ slots, i64* __restrict__ hit_slots, i64* __restrict__ missed,
                        i64* __restrict__ lookups, const FoundSlots* found = nullptr) {
    // Each thread finds, touches and lists its own share of the keys, the lists at offsets from the
    // shares before it: they come out in key order whatever the thread count.
    std::vector<i64> share_misses(omp_get_max_threads() + 1, 0);
    i64 hit_lookups = 0, missed_lookups = 0;
#pragma omp parallel if (n >= PARALLEL_FROM) reduction(+ : hit_lookups, missed_lookups)
    {
        const int thread = omp_get_thread_num(), team = omp_get_num_threads();
        const i64 first = n * thread / team, last = n * (thread + 1) / team;
        if (found) {
            for (i64 i = first; i < last; ++i) slots[i] = found->of(i);
        } else {
            slots_of(table_keys, table_values, mask, slot_keys, layout, keys, first, last, slots);
        }
        // The hits touched (and pinned) by the thread that found them: the keys are distinct, so
        // each score (and pin) has one writer.
        i64 own_misses = 0;
        for (i64 i = first; i < last; ++i) {
            if (i + AHEAD < last && slots[i + AHEAD] >= 0) {
                __builtin_prefetch(&scores[slots[i + AHEAD]], 1);
                if (pins) __builtin_prefetch(&pins[slots[i + AHEAD]], 1);
            }
            if (slots[i] < 0) {
                ++own_misses;
                missed_lookups += counts[i];
                continue;
            }
            hit_lookups += counts[i];
            add_count(scores, slots[i], counts[i], increment);
            if (pins) pins[slots[i]] = (unsigned char)(pins[slots[i]] + 1);
        }
        share_misses[thread + 1] = own_misses;
#pragma omp barrier
        i64 missing = 0;
        for (int t = 0; t <= thread; ++t) missing += share_misses[t];
        i64 hitting = first - missing;
        for (i64 i = first; i < last; ++i) {  // the lists, in key order
            const i64 slot = slots[i];
            if (slot < 0)
                missed[missing++] = i;
            else
                hit_slots[hitting++] = slot;
        }
    }
    i64 misses = 0;
    for (const i64 share : share_misses) misses += share;
    lookups[0] = hit_lookups;
    lookups[1] = missed_lookups;
    return misses;
}

extern "C" i64 cache_resolve(const i64* __restrict__ table_keys, const int* __restrict__ table_values,
                             i64 mask, const i64* __restrict__ slot_keys, const i64* __restrict__ bases,
                             const i64* __restrict__ sizes, i64 tables, i64 tier_slots,
                             const i64* __restrict__ keys, const i64* __restrict__ counts, i64 n,
                             float* __restrict__ scores, float increment, i64* __restrict__ slots,
                             i64* __restrict__ hit_slots, i64* __restrict__ missed,
                             i64* __restrict__ lookups) {
    const DirectLayout layout{bases, sizes, tables, tier_slots};
    return resolve_keys(table_keys, table_values, mask, slot_keys, layout, keys, counts, n, scores, increment,
                        nullptr, slots, hit_slots, missed, lookups);
}
// scores[slots[i]] += counts[i] x increment for slots[0..n) (distinct), on one thread, rounded as
// cache_resolve rounds it.
extern "C" void cache_add_counts(float* __restrict__ scores, const i64* __restrict__ slots,
                                 const i64* __restrict__ counts, i64 n, float increment) {
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n) __builtin_prefetch(&scores[slots[i + AHEAD]], 1);
        add_count(scores, slots[i], counts[i], increment);
    }
}

#pragma GCC pop_options

// pins[slots[i]] += delta for slots[0..n) (distinct; uint8 counts wrapping as the undo expects), and
// values[slots[i]] = 0 (float), each on one thread but for a batch's tens of thousands of hits'
// pins (a few thousand slots cost less than waking the team).
extern "C" void cache_pins_add(unsigned char* __restrict__ pins, const i64* __restrict__ slots, i64 n,
                               i64 delta) {
#pragma omp parallel for schedule(static) if (n >= 8 * PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n) __builtin_prefetch(&pins[slots[i + AHEAD]], 1);
        pins[slots[i]] = (unsigned char)(pins[slots[i]] + delta);
    }
}

extern "C" void cache_zero_at(float* __restrict__ values, const i64* __restrict__ slots, i64 n) {
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n) __builtin_prefetch(&values[slots[i + AHEAD]], 1);
        values[slots[i]] = 0.0f;
    }
}

// Score bits beside the slot: ordering these orders slots by (score, slot), scores being finite and
// non-negative (so they order as their bits do).
static inline u64 ranked_slot(const float* __restrict__ scores, i64 slot) {
    unsigned int bits;
    std::memcpy(&bits, &scores[slot], sizeof bits);
    return ((u64)bits << 32) | (u64)slot;
}

static inline bool evictable(const i64* __restrict__ slot_keys, const unsigned char* __restrict__ pins,
                             i64 slot) {
    return slot_keys[slot] >= 0 && !pins[slot];
}

#define SAMPLE_EVERY 64  // slots: one in this many is sampled to bound the scores worth ranking

// The `need` smallest of items[0..n) (distinct; 0 < need <= n) into out[0..need), in no order; out
// has room for need + 1, items is overwritten. A radix select without data-dependent branches: each
// round counts the items by 8 bits under their range's highest differing bit, keeps those in lower
// buckets and goes on with the bucket holding the need-th (the branches of a quickselect's
// comparisons mispredict on half of them; on fresh scores every step that costs it several times more).
static void select_lowest(u64* __restrict__ items, i64 n, i64 need, u64* __restrict__ out) {
    i64 taken = 0;
    while (need < n) {
        u64 low = items[0], high = items[0];
        for (i64 i = 1; i < n; ++i) {
            low = std::min(low, items[i]);
            high = std::max(high, items[i]);
        }
        const int top = 63 - __builtin_clzll(high - low);  // high > low: the items are distinct
        const int shift = top >= 7 ? top - 7 : 0;          // (high - low) >> shift < 256
        i64 histogram[256] = {0};
        for (i64 i = 0; i < n; ++i) ++histogram[(items[i] - low) >> shift];
        i64 below = 0;
        u64 bucket = 0;
        while (below + histogram[bucket] < need) below += histogram[bucket++];
        i64 kept = 0;
        for (i64 i = 0; i < n; ++i) {
            const u64 item = items[i];
            const u64 of = (item - low) >> shift;
            out[taken] = item;  // out has room for one more
            taken += of < bucket;
            items[kept] = item;
            kept += of == bucket;
        }
        n = kept;
        need -= below;
    }
    std::memcpy(out + taken, items, need * sizeof(u64));
}

// items[0..n) sorted ascending, as std::sort sorts them, by a least-significant-digit radix sort a
// byte at a time, leaving out the bytes every item shares (a pool's slots and low scores vary in a
// few of their eight); scratch has room for n items. A comparison sort's branches mispredict on
// about half of its comparisons of fresh scores, which costs it several times more here.
static void radix_sort(u64* __restrict__ items, i64 n, u64* __restrict__ scratch) {
    if (n < 2) return;
    u64 varying = 0;
    for (i64 i = 1; i < n; ++i) varying |= items[i] ^ items[0];
    u64 *from = items, *to = scratch;
    for (int shift = 0; shift < 64; shift += 8) {
        if (((varying >> shift) & 0xFF) == 0) continue;
        i64 starts[256] = {0};
        for (i64 i = 0; i < n; ++i) ++starts[(from[i] >> shift) & 0xFF];
        i64 at = 0;
        for (i64& start : starts) {
            const i64 count = start;
            start = at;
            at += count;
        }
        for (i64 i = 0; i < n; ++i) to[starts[(from[i] >> shift) & 0xFF]++] = from[i];
        std::swap(from, to);
    }
    if (from != items) std::memcpy(items, from, n * sizeof(u64));
}

// Whether LFU's scan of a tier of `capacity` slots runs on the calling thread alone (a smaller tier's
// scan costs less than waking a team).
static inline bool scan_on_one_thread(i64 capacity) { return capacity < 64 * PARALLEL_FROM; }

// The ranked_slot of every evictable slot whose item is at most `bound`, in slot order, into
// candidates (room for capacity items); returns how many. A large tier's slots are split in runs, one
// a thread; each run packs its items, without a branch a slot, from the start of its own range of
// candidates (never past it), and the runs then move down into place in run order: the same items,
// in the same order, whatever the thread count.
static i64 evictable_slots(const float* __restrict__ scores, const i64* __restrict__ slot_keys,
                           const unsigned char* __restrict__ pins, i64 capacity, u64 bound,
                           u64* __restrict__ candidates) {
    const int threads = scan_on_one_thread(capacity) ? 1 : omp_get_max_threads();
    std::vector<i64> packed(threads, 0);
    int runs = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        if (t == 0) runs = team;
        const i64 first = capacity * t / team, last = capacity * (t + 1) / team;
        i64 count = 0;
        for (i64 s = first; s < last; ++s) {
            const u64 item = ranked_slot(scores, s);
            candidates[first + count] = item;
            count += evictable(slot_keys, pins, s) && item <= bound;
        }
        packed[t] = count;
    }
    i64 total = 0;
    for (int t = 0; t < runs; ++t) {
        std::memmove(candidates + total, candidates + capacity * t / runs, packed[t] * sizeof(u64));
        total += packed[t];
    }
    return total;
}

// The `count` lowest-scoring slots among those holding a row (slot_keys >= 0) and not pinned
// (pins == 0), in ascending order of (score, slot), into out; fewer if fewer qualify. Returns how
// many were written. The first `head` of them are the `head` lowest in no particular order (LFU's
// victims: only the pool after them needs its order). A large tier first samples its scores for a
// bound that `count` of them are likely under and ranks only the slots at or under it (all slots
// if too few are): the same slots.
extern "C" i64 cache_lowest_slots(const float* __restrict__ scores, const i64* __restrict__ slot_keys,
                                  const unsigned char* __restrict__ pins, i64 capacity, i64 count, i64 head,
                                  i64* __restrict__ out) {
    // Scratch not zeroed: the runs write only the items they keep, so pages past those are never
    // touched (a cleared vector of capacity items would write, and fault in, every page of it).
    // The sample's share of `count`, a quarter more and 16 samples: a bound that covers fewer slots
    // than `count` (the sample misled) falls back to ranking every slot.
    const i64 wanted = count / SAMPLE_EVERY + count / (4 * SAMPLE_EVERY) + 16;
    Room<u64> items(capacity + 1), chosen(std::max(2 * (std::min(count, capacity) + 1), wanted + 2));
    u64* const candidates = items.data();  // ranked slots (ranked_slot)
    i64 n = 0;
    if (capacity >= 64 * SAMPLE_EVERY && count < capacity / 4) {
        i64 sampled = 0;
        for (i64 s = 0; s < capacity; s += SAMPLE_EVERY) {
            candidates[sampled] = ranked_slot(scores, s);
            sampled += evictable(slot_keys, pins, s);
        }
        if (wanted < sampled) {
            select_lowest(candidates, sampled, wanted + 1, chosen.data());
            const u64 bound = *std::max_element(chosen.data(), chosen.data() + wanted + 1) | 0xFFFFFFFFULL;
            // every evictable slot of that score or lower
            n = evictable_slots(scores, slot_keys, pins, capacity, bound, candidates);
            if (n < count) n = 0;  // the sample misled: rank every slot
        }
    }
    if (n == 0) n = evictable_slots(scores, slot_keys, pins, capacity, ~0ULL, candidates);
    const i64 kept = std::min<i64>(count, n);
    if (kept == 0) return 0;
    u64* const lowest = chosen.data();  // the kept lowest, then a copy of them
    u64* const ranked = candidates;     // the head lowest, then the rest ascending
    select_lowest(candidates, n, kept, lowest);
    const i64 unsorted = std::min<i64>(head, kept);
    if (unsorted == 0 || unsorted == kept) {
        std::memcpy(ranked, lowest, kept * sizeof(u64));
    } else {
        u64* const copy = lowest + kept + 1;
        std::memcpy(copy, lowest, kept * sizeof(u64));
        select_lowest(copy, kept, unsorted, ranked);
        const u64 bound = *std::max_element(ranked, ranked + unsorted);
        i64 after = unsorted;
        for (i64 i = 0; i < kept; ++i) {
            ranked[after] = lowest[i];
            after += lowest[i] > bound;
        }
    }
    radix_sort(ranked + unsorted, kept - unsorted, chosen.data());  // lowest and copy are done with
    for (i64 i = 0; i < kept; ++i) out[i] = (i64)(ranked[i] & 0xFFFFFFFFULL);
    return kept;
}

// LFU's pool (slots ranked by a scan, with the scores and keys they had then): the first `count`
// of pool[0..n) still holding that key and score and not pinned, into out. Returns how many pool
// entries that consumed, or -1 if fewer than `count` qualify.
extern "C" i64 cache_pool_take(const i64* __restrict__ pool, const float* __restrict__ pool_scores,
                               const i64* __restrict__ pool_keys, i64 n, const float* __restrict__ scores,
                               const i64* __restrict__ slot_keys, const unsigned char* __restrict__ pins,
                               i64 count, i64* __restrict__ out) {
    if (count == 0) return 0;
    i64 found = 0;
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n) __builtin_prefetch(&slot_keys[pool[i + AHEAD]]);
        const i64 s = pool[i];
        if (scores[s] != pool_scores[i] || slot_keys[s] != pool_keys[i] || pins[s]) continue;
        out[found++] = s;
        if (found == count) return i + 1;
    }
    return -1;
}

// The rows at slots[0..n): out_keys[i], out_rows[i] (row_bytes bytes: rows of any dtype), out_dirty[i],
// out_fresh[i].
extern "C" void cache_slot_rows(const i64* __restrict__ slot_keys, const char* __restrict__ rows,
                                i64 row_bytes, const unsigned char* __restrict__ dirty,
                                const unsigned char* __restrict__ fresh, const i64* __restrict__ slots, i64 n,
                                i64* __restrict__ out_keys, char* __restrict__ out_rows,
                                unsigned char* __restrict__ out_dirty,
                                unsigned char* __restrict__ out_fresh) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n) prefetch_lines(&rows[slots[i + AHEAD] * row_bytes], row_bytes);
        const i64 s = slots[i];
        out_keys[i] = slot_keys[s];
        out_dirty[i] = dirty[s];
        out_fresh[i] = fresh[s];
        std::memcpy(&out_rows[i * row_bytes], &rows[s * row_bytes], row_bytes);
    }
}

// An admission's writes: slot slots[i] takes keys[i], the row incoming[i] (row_bytes bytes) and
// the flags in_dirty[i] / in_fresh[i].
extern "C" void cache_fill_slots(i64* __restrict__ slot_keys, char* __restrict__ rows, i64 row_bytes,
                                 unsigned char* __restrict__ dirty, unsigned char* __restrict__ fresh,
                                 const i64* __restrict__ slots, i64 n, const i64* __restrict__ keys,
                                 const char* __restrict__ incoming,
                                 const unsigned char* __restrict__ in_dirty,
                                 const unsigned char* __restrict__ in_fresh) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n) prefetch_lines<1>(&rows[slots[i + AHEAD] * row_bytes], row_bytes);
        const i64 s = slots[i];
        slot_keys[s] = keys[i];
        dirty[s] = in_dirty[i];
        fresh[s] = in_fresh[i];
        std::memcpy(&rows[s * row_bytes], &incoming[i * row_bytes], row_bytes);
    }
}
