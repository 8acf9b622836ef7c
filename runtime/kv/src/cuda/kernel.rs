//! The CUDA C source compiled at run time with NVRTC: the gather/scatter copy kernel that executes
//! a whole transfer plan (seed step 29) in one launch, and the pattern fill used to seed KV.

/// Each thread block takes work items (slices of at most 64 KiB of one descriptor) in a grid-stride
/// loop; where source, destination and length are 16-byte aligned it copies with 16-byte vector
/// loads and stores, four in flight per thread, else byte by byte.
pub const SOURCE: &str = r#"
extern "C" __global__ void pdflow_gather_scatter(
    const unsigned long long* __restrict__ src,
    const unsigned long long* __restrict__ dst,
    const unsigned long long* __restrict__ len,
    unsigned int n)
{
    for (unsigned int c = blockIdx.x; c < n; c += gridDim.x) {
        unsigned long long s = src[c], d = dst[c], l = len[c];
        if (((s | d | l) & 15ull) == 0) {
            const uint4* s4 = (const uint4*)s;
            uint4* d4 = (uint4*)d;
            unsigned long long n4 = l >> 4, i = threadIdx.x, b = blockDim.x;
            for (; i + 3 * b < n4; i += 4 * b) {
                uint4 x0 = s4[i], x1 = s4[i + b], x2 = s4[i + 2 * b], x3 = s4[i + 3 * b];
                d4[i] = x0; d4[i + b] = x1; d4[i + 2 * b] = x2; d4[i + 3 * b] = x3;
            }
            for (; i < n4; i += b) d4[i] = s4[i];
        } else {
            const unsigned char* s1 = (const unsigned char*)s;
            unsigned char* d1 = (unsigned char*)d;
            for (unsigned long long i = threadIdx.x; i < l; i += blockDim.x) d1[i] = s1[i];
        }
    }
}

extern "C" __global__ void pdflow_fill(unsigned long long* p, unsigned long long words, unsigned long long seed)
{
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < words;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
        x ^= x >> 31; x *= 0xBF58476D1CE4E5B9ull; x ^= x >> 29;
        p[i] = x;
    }
}
"#;
