// Reference cache policies replayed over a key trace, every miss admitted (demand paging): Belady's
// MIN (one access at a time, or over batches resident whole), LRU and FIFO, as
// tierstore/analysis/reference_policies.py defines them in Python (the oracle the tests hold these
// to). Built by tierstore/kernels/replay.py with g++.
//
// Keys are dense: keys[p] in [0, distinct) for accesses p in [0, n); `following[p]` is the position
// of the next access to the same key (NEVER: none). Each call returns the hits of one capacity.

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

typedef long long i64;

static const i64 NOT_RESIDENT = -1;

// The resident keys of a MIN replay, the one whose next use is farthest first. A max-heap of
// (next use, key) holds stale entries (a key's older next uses) that pops skip; `rebuild_if_stale`
// rebuilds it from the resident keys once stale entries outnumber them, so memory stays O(capacity).
// A key is admitted, then given its next use (`use`) before the next eviction or rebuild.
struct FarthestFirst {
    std::vector<i64> upcoming;   // a resident key's next use (NOT_RESIDENT: not resident)
    std::vector<i64> residents;  // the resident keys (for a rebuild)
    std::vector<i64> place;      // a resident key's index in residents
    std::vector<std::pair<i64, i64>> heap;
    i64 capacity;

    FarthestFirst(i64 distinct, i64 capacity_)
        : upcoming(distinct, NOT_RESIDENT), place(distinct, -1), capacity(capacity_) {
        heap.reserve(2 * capacity + 64);
    }
    bool holds(i64 key) const { return upcoming[key] != NOT_RESIDENT; }
    i64 size() const { return (i64)residents.size(); }
    void admit(i64 key) {
        place[key] = size();
        residents.push_back(key);
    }
    void use(i64 key, i64 next) {
        upcoming[key] = next;
        heap.push_back({next, key});
        std::push_heap(heap.begin(), heap.end());
    }
    void evict_farthest() {
        while (true) {
            std::pop_heap(heap.begin(), heap.end());
            const std::pair<i64, i64> top = heap.back();
            heap.pop_back();
            if (upcoming[top.second] != top.first) continue;  // stale
            const i64 victim = top.second, index = place[victim];
            upcoming[victim] = NOT_RESIDENT;
            residents[index] = residents.back();
            place[residents[index]] = index;
            residents.pop_back();
            place[victim] = -1;
            return;
        }
    }
    void rebuild_if_stale() {
        if ((i64)heap.size() <= 2 * capacity + 64) return;
        heap.clear();
        for (const i64 resident : residents) heap.push_back({upcoming[resident], resident});
        std::make_heap(heap.begin(), heap.end());
    }
};

// MIN: on a miss with a full cache, evict the resident key whose next use is farthest.
extern "C" i64 replay_belady(const i64* keys, const i64* following, i64 n, i64 distinct, i64 capacity) {
    FarthestFirst cache(distinct, capacity);
    i64 hits = 0;
    for (i64 p = 0; p < n; ++p) {
        const i64 key = keys[p];
        if (cache.holds(key)) {
            ++hits;
        } else {
            if (cache.size() >= capacity) cache.evict_farthest();
            cache.admit(key);
        }
        cache.use(key, following[p]);
        cache.rebuild_if_stale();
    }
    return hits;
}

// MIN over batches (a batched store's ceiling): accesses come in batches of `batch` (the last may
// be shorter) whose distinct keys must all be resident at once, every miss admitted when its batch
// runs; a full cache evicts, for each miss, the resident key outside the batch whose next use is
// farthest (Belady's choice, which no batched schedule beats). Hits: the batch's lookups less the
// keys it brings in (a key brought in once serves all its lookups in the batch). Returns -1 where
// a batch holds more distinct keys than `capacity`.
extern "C" i64 replay_belady_batched(const i64* keys, const i64* following, i64 n, i64 distinct, i64 capacity,
                                     i64 batch) {
    FarthestFirst cache(distinct, capacity);
    std::vector<i64> seen_in(distinct, -1);  // the last batch (its first access) that looked a key up
    std::vector<i64> misses;
    i64 hits = 0;
    for (i64 start = 0; start < n; start += batch) {
        const i64 end = std::min(n, start + batch);
        misses.clear();
        i64 looked_up = 0;  // the batch's distinct keys
        for (i64 p = start; p < end; ++p) {
            const i64 key = keys[p];
            if (seen_in[key] == start) continue;
            seen_in[key] = start;
            ++looked_up;
            if (!cache.holds(key)) misses.push_back(key);
        }
        if (looked_up > capacity) return -1;
        hits += (end - start) - (i64)misses.size();
        // A batch key's next use lies in the batch, nearer than any other resident key's: it is
        // evicted only once those are gone, which the check above rules out.
        for (i64 need = cache.size() + (i64)misses.size() - capacity; need > 0; --need)
            cache.evict_farthest();
        for (const i64 key : misses) cache.admit(key);
        for (i64 p = start; p < end; ++p)  // each batch key's next use: its last access's
            if (following[p] >= end) cache.use(keys[p], following[p]);
        cache.rebuild_if_stale();
    }
    return hits;
}

// LRU: a doubly linked list of the resident keys, most recent at the head.
extern "C" i64 replay_lru(const i64* keys, i64 n, i64 distinct, i64 capacity) {
    std::vector<i64> before(distinct, NOT_RESIDENT), after(distinct, NOT_RESIDENT);
    std::vector<char> resident(distinct, 0);
    i64 head = NOT_RESIDENT, tail = NOT_RESIDENT, size = 0, hits = 0;
    auto unlink = [&](i64 key) {
        if (before[key] != NOT_RESIDENT)
            after[before[key]] = after[key];
        else
            head = after[key];
        if (after[key] != NOT_RESIDENT)
            before[after[key]] = before[key];
        else
            tail = before[key];
    };
    for (i64 p = 0; p < n; ++p) {
        const i64 key = keys[p];
        if (resident[key]) {
            ++hits;
            unlink(key);
        } else if (size >= capacity) {
            const i64 victim = tail;
            unlink(victim);
            resident[victim] = 0;
        } else {
            ++size;
        }
        resident[key] = 1;
        before[key] = NOT_RESIDENT;
        after[key] = head;
        if (head != NOT_RESIDENT) before[head] = key;
        head = key;
        if (tail == NOT_RESIDENT) tail = key;
    }
    return hits;
}

// FIFO: keys leave in the order they came in; a hit changes nothing.
extern "C" i64 replay_fifo(const i64* keys, i64 n, i64 distinct, i64 capacity) {
    std::vector<char> resident(distinct, 0);
    std::vector<i64> queue(capacity);
    i64 first = 0, size = 0, hits = 0;
    for (i64 p = 0; p < n; ++p) {
        const i64 key = keys[p];
        if (resident[key]) {
            ++hits;
            continue;
        }
        if (size >= capacity) {
            resident[queue[first]] = 0;
            queue[first] = key;
            first = (first + 1) % capacity;
        } else {
            queue[(first + size) % capacity] = key;
            ++size;
        }
        resident[key] = 1;
    }
    return hits;
}
