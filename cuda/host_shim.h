// Lets embedding_cache.cu compile as plain C++ (g++): the CPU build that the host cache tier and the
// mmap store's key indexes run on (with OpenMP), and the one-thread build the tests check against
// the torch reference. Without OpenMP one thread runs each kernel's whole grid-stride loop
// (blockIdx 0, threadIdx 0, blockDim and gridDim 1); atomics map to the compiler's builtins.
// Kernels are called directly through ctypes (tierstore/kernels/host.py).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __forceinline__ inline
// A helper that only asks for memory (__builtin_prefetch): GCC counts a prefetch as no effect, so at
// -O3 it deleted calls to such helpers that it had not inlined, prefetches and all (measured with
// GCC 12). Always inlined, they stay.
#define PREFETCHING __attribute__((always_inline)) static inline

struct tierstore_dim3 {
    unsigned int x, y, z;
};
static const tierstore_dim3 threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0};
static const tierstore_dim3 blockDim = {1, 1, 1}, gridDim = {1, 1, 1};

struct float4 {
    float x, y, z, w;
};

inline unsigned long long atomicCAS(unsigned long long* address, unsigned long long compare,
                                    unsigned long long value) {
    __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;  // the old value, as CUDA's atomicCAS returns
}

inline float atomicAdd(float* address, float value) {
    float old;
    __atomic_load(address, &old, __ATOMIC_SEQ_CST);
    float updated = old + value;
    while (!__atomic_compare_exchange(address, &old, &updated, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        updated = old + value;
    }
    return old;
}

inline float __uint_as_float(unsigned int bits) {
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

inline unsigned int __float_as_uint(float value) {
    unsigned int bits;
    std::memcpy(&bits, &value, sizeof bits);
    return bits;
}
