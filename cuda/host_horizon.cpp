// A lookahead horizon's passes (tierstore/horizon.py's Foresight, through
// tierstore/kernels/step_passes.py; included by host_step.cpp into the tuned host build), each one
// call a batch:
// - horizon_enter: a batch read ahead links each of its ids to its latest entry in the horizon
//   (an id -> entry map, linear probing without tombstones), giving that entry this batch as its
//   next use; an id new to the horizon whose row is resident in the top tier gets the horizon's pin;
// - horizon_consume: a batch has run: each of its rows' pins follows its id's next use (kept, with
//   the next use recorded, or dropped where there is none), its ids with no next use leave the map,
//   and the slots the next batch needs beyond the horizon's pins are counted.
// Each entry keeps a hint of its row's slot (entry_slot, beside next_use): found when its batch
// entered, found again when the batch before it was consumed. A hint is taken only where the tier's
// slot_keys still holds the key there (most rows: the horizon's pins keep them in place), the index
// probed for the rest.
// The map's changes run on one thread, the tier's side beside them on another (from PARALLEL_FROM
// keys). Entries are numbered (codes); an entry's next use lives at next_use[code & ring_mask]
// (NEVER: none in the horizon). The horizon's pin of a slot: pinned_key[slot] holds the slot's key
// and pins[slot] (the tier's pin count, which the window's pins share) counts it once.

#define HORIZON_NEVER 0x7fffffff  // a next use (a batch number, int) of none

// The top tier and the horizon's per-slot record of it.
struct HorizonTier {
    const i64* index_keys;
    const int* index_values;
    i64 index_mask;
    unsigned char* pins;
    i64* pinned_key;   // [capacity]: the key the horizon pinned at a slot, -1: none
    int* pinned_next;  // [capacity]: that row's next use (a batch number)
    const i64* slot_keys;
    DirectLayout direct;  // the tier's homes (tables 0: none), as cache_resolve reads them
    i64 slots;            // the tier's slots now
};

static inline i64 horizon_slot(const HorizonTier& tier, i64 key) {
    return slot_of(tier.index_keys, tier.index_values, tier.index_mask, tier.slot_keys, tier.direct, key);
}

PREFETCHING void prefetch_horizon_slot(const HorizonTier& tier, i64 key) {
    prefetch_slot_of(tier.index_keys, tier.index_values, tier.index_mask, tier.slot_keys, tier.direct, key);
}

// The slot of `key`: `hint` where that slot holds the key now, else found through the index.
static inline i64 hinted_slot(const HorizonTier& tier, i64 key, int hint) {
    if (hint >= 0 && hint < tier.slots && tier.slot_keys[hint] == key) return hint;
    return horizon_slot(tier, key);
}

PREFETCHING void prefetch_hinted_slot(const HorizonTier& tier, i64 key, int hint) {
    if (hint >= 0 && hint < tier.slots)
        __builtin_prefetch(&tier.slot_keys[hint]);
    else
        prefetch_horizon_slot(tier, key);
}

static inline bool horizon_holds(const HorizonTier& tier, i64 slot, i64 key) {
    return tier.pinned_key[slot] == key && tier.pins[slot] > 0;
}

// Whether the row at `slot` (-1: not resident) needs a slot beyond the pinned ones (the horizon's,
// and a window's, whose rows the window counts).
static inline bool horizon_needs(const HorizonTier& tier, i64 slot) {
    return slot < 0 || tier.pins[slot] == 0;
}

#define SLOT_RUN 256  // keys: a thread's share of a batch's slots found, at a time

// Pin the row of `key` at `slot` for the horizon (once), its next use `next`. Returns 1 if pinned now.
static inline i64 horizon_pin(const HorizonTier& tier, i64 slot, i64 key, i64 next) {
    tier.pinned_next[slot] = (int)next;
    if (horizon_holds(tier, slot, key)) return 0;
    tier.pins[slot] = (unsigned char)(tier.pins[slot] + 1);
    tier.pinned_key[slot] = key;
    return 1;
}

// keys[0..n) (distinct) enter as batch `sequence`, their entries coded first_code + i, each with
// its row's slot as a hint (entry_slot). The map has room for them (the caller sizes it). out[0]:
// the pins added; out[1]: the ids new to the map.
// The map's changes run on one thread (inserts claim positions in order) while the other finds the
// keys' slots in the tier, runs of them at a time, which the first joins once done; then the new
// ids' rows are pinned on the team (distinct keys hold distinct slots: one writer a slot).
extern "C" void horizon_enter(const i64* __restrict__ keys, i64 n, i64 first_code, i64 sequence,
                              i64* __restrict__ map_keys, i64* __restrict__ map_values, i64 map_mask,
                              int* __restrict__ next_use, int* __restrict__ entry_slot, i64 ring_mask,
                              const HorizonTier* tier, i64* __restrict__ out) {
    Room<i64> slots(n);
    std::vector<unsigned char> new_ids(n);
    i64 added = 0;
    std::atomic<i64> slot_run{0};
#pragma omp parallel num_threads(2) if (n >= PARALLEL_FROM)
    {
        if (omp_get_thread_num() == 0) {
            for (i64 i = 0; i < n; ++i) {
                if (i + AHEAD < n) prefetch_home<1>(map_keys, map_values, map_mask, keys[i + AHEAD]);
                const i64 key = keys[i], code = first_code + i;
                next_use[code & ring_mask] = HORIZON_NEVER;
                u64 position = mix((u64)key) & (u64)map_mask;
                while (map_keys[position] != EMPTY_KEY && map_keys[position] != key) {
                    position = (position + 1) & (u64)map_mask;
                }
                if (map_keys[position] == key) {  // its latest entry now has a next use: this batch
                    next_use[map_values[position] & ring_mask] = (int)sequence;
                    map_values[position] = code;
                    continue;
                }
                map_keys[position] = key;
                map_values[position] = code;
                new_ids[i] = 1;
                ++added;
            }
        }
        for (i64 first; (first = slot_run.fetch_add(SLOT_RUN)) < n;) {
            const i64 last = std::min(n, first + SLOT_RUN);
            for (i64 i = first; i < last; ++i) {
                if (i + AHEAD < last) prefetch_horizon_slot(*tier, keys[i + AHEAD]);
                slots[i] = horizon_slot(*tier, keys[i]);
            }
        }
    }
    i64 pinned = 0;
#pragma omp parallel for schedule(static) reduction(+ : pinned) if (n >= PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) {
        entry_slot[(first_code + i) & ring_mask] = (int)slots[i];
        if (new_ids[i] && slots[i] >= 0) pinned += horizon_pin(*tier, slots[i], keys[i], sequence);
    }
    out[0] = pinned;
    out[1] = added;
}

// keys[0..n) (distinct, coded first_code + i) have run. next_keys[0..next_n): the next batch in the
// horizon, coded next_code + i; their slots are found (their hints taken where they hold) and
// kept as their hints for the next call. out[0]: the pins added less those dropped; out[1]: the
// ids that left the map; out[2]: the next batch's ids whose rows the horizon does not pin (its
// misses, and hits the cap unpinned): the slots it may claim beyond the horizon's pins. The keys'
// slots are found on the team; then the ids with no next use leave the map on one thread (erasing
// moves entries) while another moves the pins on, each then taking runs of the next batch's slots
// to find (whichever side is longer: many ids leaving, or many pins), counting a run's ids as it
// finds them once the pins have moved on, and the other runs after.
extern "C" void horizon_consume(const i64* __restrict__ keys, i64 n, i64 first_code,
                                i64* __restrict__ map_keys, i64* __restrict__ map_values, i64 map_mask,
                                const int* __restrict__ next_use, int* __restrict__ entry_slot, i64 ring_mask,
                                const HorizonTier* tier, const i64* __restrict__ next_keys, i64 next_n,
                                i64 next_code, i64* __restrict__ out) {
    Room<i64> slots(n), next_slots(next_n);
#pragma omp parallel for schedule(static) if (n >= PARALLEL_FROM)
    for (i64 i = 0; i < n; ++i) {
        if (i + AHEAD < n)
            prefetch_hinted_slot(*tier, keys[i + AHEAD], entry_slot[(first_code + i + AHEAD) & ring_mask]);
        slots[i] = hinted_slot(*tier, keys[i], entry_slot[(first_code + i) & ring_mask]);
    }
    i64 change = 0, removed = 0;
    std::atomic<i64> next_run{0}, needed{0};
    std::atomic<bool> pins_moved{false};
    const i64 runs = (next_n + SLOT_RUN - 1) / SLOT_RUN;
    Room<unsigned char> counted(runs);  // runs whose ids were counted as their slots were found
#pragma omp parallel num_threads(2) if (n + next_n >= PARALLEL_FROM)
    {
        const int side = omp_get_thread_num(), team = omp_get_num_threads();
        if (side == 0) {
            i64 removed_value = 0;
            for (i64 i = 0; i < n; ++i) {
                if (i + AHEAD < n && next_use[(first_code + i + AHEAD) & ring_mask] == HORIZON_NEVER)
                    prefetch_home<1>(map_keys, map_values, map_mask, keys[i + AHEAD]);
                if (next_use[(first_code + i) & ring_mask] == HORIZON_NEVER)
                    removed += erase_shifting(map_keys, map_values, map_mask, &keys[i], 1, &removed_value);
            }
        }
        if (side == 1 || team == 1) {
            for (i64 i = 0; i < n; ++i) {
                const i64 slot = slots[i], key = keys[i];
                if (slot < 0) continue;
                const i64 following = next_use[(first_code + i) & ring_mask];
                if (following != HORIZON_NEVER) {
                    change += horizon_pin(*tier, slot, key, following);
                } else if (horizon_holds(*tier, slot, key)) {
                    tier->pins[slot] = (unsigned char)(tier->pins[slot] - 1);
                    tier->pinned_key[slot] = -1;
                    change -= 1;
                }
            }
            pins_moved.store(true, std::memory_order_release);
        }
        // The next batch's slots (its rows' pins, once moved on, counted beside them), a run at a time.
        for (i64 first; (first = next_run.fetch_add(SLOT_RUN)) < next_n;) {
            const i64 last = std::min(next_n, first + SLOT_RUN);
            const bool count = pins_moved.load(std::memory_order_acquire);
            i64 run_needed = 0;
            for (i64 i = first; i < last; ++i) {
                int* hint = &entry_slot[(next_code + i) & ring_mask];
                if (i + AHEAD < last)
                    prefetch_hinted_slot(*tier, next_keys[i + AHEAD],
                                         entry_slot[(next_code + i + AHEAD) & ring_mask]);
                const i64 slot = hinted_slot(*tier, next_keys[i], *hint);
                next_slots[i] = slot;
                *hint = (int)slot;
                if (count) run_needed += horizon_needs(*tier, slot);
            }
            counted[first / SLOT_RUN] = count;
            if (count) needed += run_needed;
        }
    }
    // Runs found while the pins were moving on are counted after (a key in both batches keeps its pin).
    i64 late = 0;
#pragma omp parallel for schedule(static) reduction(+ : late) if (next_n >= PARALLEL_FROM)
    for (i64 r = 0; r < runs; ++r) {
        if (counted[r]) continue;
        for (i64 i = r * SLOT_RUN; i < std::min(next_n, (r + 1) * SLOT_RUN); ++i)
            late += horizon_needs(*tier, next_slots[i]);
    }
    out[0] = change;
    out[1] = removed;
    out[2] = needed + late;
}

// The horizon's pins past `keep` dropped, the farthest next use first (ties: the lower slot first),
// over a tier of `capacity` slots whose keys are slot_keys; only pins of rows no one else pins
// (a window's) are dropped, since only those free a slot. Records of rows taken out of the tier
// since (another key there, or no pin left) are cleared. scratch: capacity ints. out[0]: the pins
// it holds now; out[1]: how many it dropped.
extern "C" void horizon_drop_farthest(const HorizonTier* tier, const i64* __restrict__ slot_keys,
                                      i64 capacity, i64 keep, int* __restrict__ scratch,
                                      i64* __restrict__ out) {
    i64 held = 0, alone = 0;
    for (i64 slot = 0; slot < capacity; ++slot) {
        const i64 key = tier->pinned_key[slot];
        if (key < 0) continue;
        if (slot_keys[slot] != key || tier->pins[slot] == 0) {
            tier->pinned_key[slot] = -1;
            continue;
        }
        ++held;
        if (tier->pins[slot] == 1) scratch[alone++] = (int)slot;  // another's pin keeps its slot anyway
    }
    const i64 excess = held > keep ? held - keep : 0;
    const i64 dropped = excess < alone ? excess : alone;
    if (dropped) {
        const int* next = tier->pinned_next;
        std::nth_element(scratch, scratch + dropped - 1, scratch + alone,
                         [next](int a, int b) { return next[a] > next[b] || (next[a] == next[b] && a < b); });
        for (i64 i = 0; i < dropped; ++i) {
            const int slot = scratch[i];
            tier->pins[slot] = (unsigned char)(tier->pins[slot] - 1);
            tier->pinned_key[slot] = -1;
        }
    }
    out[0] = held - dropped;
    out[1] = dropped;
}
