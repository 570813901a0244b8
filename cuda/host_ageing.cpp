// Shadow caches for LFU's ageing chosen online (tierstore/tiers/ageing.py; included by host_step.cpp
// into the tuned host build): a spatial sample of a tier's lookups (ids whose hash falls under a
// threshold) replayed through small LFU caches, one per candidate half-life, each access at a time
// on one thread, counting their hits. Each shadow: slots of keys and scores (an access adds
// `increment`, which grows by `growth` per access, as tierstore/tiers/policies.py's LfuWithAgeing
// weighs them), a map key -> slot (linear probing, erase by backward shifting) and a min-heap of
// (score when pushed, slot), one entry a slot; the scores are renormalised (and the heap rebuilt)
// when `increment` grows large.

#define SHADOWS_PARALLEL_FROM 64  // shadow accesses: fewer run on the calling thread

struct ShadowEntry {
    double score;
    i64 slot;
};

struct ShadowLater {  // a min-heap's order: a functor, so the heap's comparisons inline
    bool operator()(const ShadowEntry& a, const ShadowEntry& b) const {
        return a.score > b.score || (a.score == b.score && a.slot > b.slot);
    }
};

struct AgeingShadow {
    i64* slot_keys;  // [capacity], -1: free
    double* scores;  // [capacity]
    i64* map_keys;   // [map_mask + 1], EMPTY_KEY: free
    i64* map_slots;  // [map_mask + 1]
    i64 map_mask;
    ShadowEntry* heap;  // [capacity]
    i64 heap_size;
    i64 capacity, used;
    double increment, growth;
    i64 hits;  // hits since the caller last took them
};

static void shadow_rebuild_heap(AgeingShadow& shadow) {
    shadow.heap_size = 0;
    for (i64 slot = 0; slot < shadow.used; ++slot)
        shadow.heap[shadow.heap_size++] = {shadow.scores[slot], slot};
    std::make_heap(shadow.heap, shadow.heap + shadow.heap_size, ShadowLater());
}

// The slot of the lowest (score, slot), its key removed from the map. Each slot has one heap entry,
// its score when pushed: scores only grow, so an entry whose slot scores more now is pushed again
// with its score, and the first entry that still holds its slot's score is the lowest.
static i64 shadow_evict(AgeingShadow& shadow) {
    while (true) {
        std::pop_heap(shadow.heap, shadow.heap + shadow.heap_size, ShadowLater());
        ShadowEntry& top = shadow.heap[shadow.heap_size - 1];
        if (shadow.scores[top.slot] != top.score) {  // raised since it was pushed
            top.score = shadow.scores[top.slot];
            std::push_heap(shadow.heap, shadow.heap + shadow.heap_size, ShadowLater());
            continue;
        }
        --shadow.heap_size;
        i64 former = 0;
        erase_shifting(shadow.map_keys, shadow.map_slots, shadow.map_mask, &shadow.slot_keys[top.slot], 1,
                       &former);
        return top.slot;
    }
}

static void shadow_access(AgeingShadow& shadow, i64 key, i64 count) {
    u64 position = mix((u64)key) & (u64)shadow.map_mask;
    while (shadow.map_keys[position] != EMPTY_KEY && shadow.map_keys[position] != key) {
        position = (position + 1) & (u64)shadow.map_mask;
    }
    if (shadow.map_keys[position] == key) {  // a hit: the score grows, its heap entry stays
        shadow.hits += count;
        shadow.scores[shadow.map_slots[position]] += (double)count * shadow.increment;
    } else {
        shadow.hits += count - 1;  // the first lookup brings the row in, the batch's others hit
        const i64 slot = shadow.used < shadow.capacity ? shadow.used++ : shadow_evict(shadow);
        // the eviction may have shifted entries: find the key's empty position again
        position = mix((u64)key) & (u64)shadow.map_mask;
        while (shadow.map_keys[position] != EMPTY_KEY) position = (position + 1) & (u64)shadow.map_mask;
        shadow.map_keys[position] = key;
        shadow.map_slots[position] = slot;
        shadow.slot_keys[slot] = key;
        shadow.scores[slot] = 0.0 + (double)count * shadow.increment;
        shadow.heap[shadow.heap_size++] = {shadow.scores[slot], slot};
        std::push_heap(shadow.heap, shadow.heap + shadow.heap_size, ShadowLater());
    }
    shadow.increment *= count == 1 ? shadow.growth : std::pow(shadow.growth, (double)count);
    if (shadow.increment > 1e30) {
        for (i64 s = 0; s < shadow.used; ++s) shadow.scores[s] /= shadow.increment;
        shadow.increment = 1.0;
        shadow_rebuild_heap(shadow);
    }
}

// keys[0..n) (distinct), each looked up counts[i] times: those sampled (a multiply-shift hash of the
// key below `threshold`, out of 2^53) are replayed through shadows[0..count). Each shadow's hits
// fade: hits[s] = hits[s] x 2^(-sampled / memory) + its hits now. Returns the lookups sampled.
extern "C" i64 ageing_replay(const i64* __restrict__ keys, const i64* __restrict__ counts, i64 n,
                             u64 threshold, AgeingShadow* shadows, i64 count, double memory,
                             double* __restrict__ hits) {
    std::vector<i64> chosen;  // the sampled keys' positions
    i64 sampled = 0;
    for (i64 i = 0; i < n; ++i) {
        if ((((u64)keys[i] * 0x9E3779B97F4A7C15ULL) >> 11) >= threshold) continue;
        chosen.push_back(i);
        sampled += counts[i];
    }
    const i64 replayed = (i64)chosen.size();
    // The shadows are independent: each replays every sampled key in order, on whichever thread, in
    // a copy of its record (the records lie side by side: threads writing them would share lines).
#pragma omp parallel for schedule(static, 1) if (replayed * count >= SHADOWS_PARALLEL_FROM)
    for (i64 s = 0; s < count; ++s) {
        AgeingShadow shadow = shadows[s];
        for (i64 j = 0; j < replayed; ++j) shadow_access(shadow, keys[chosen[j]], counts[chosen[j]]);
        shadows[s] = shadow;
    }
    if (sampled == 0) return 0;
    const double fade = std::exp2(-(double)sampled / memory);
    for (i64 s = 0; s < count; ++s) {
        hits[s] = hits[s] * fade + (double)shadows[s].hits;
        shadows[s].hits = 0;
    }
    return sampled;
}
