// What the multi-tensor kernels share (scale.cu's scale and norm, casts.cu's multi-tensor casts): the host
// builds a table of int64 rows, one per tensor, whose column FIRST holds the tensor's first block; tensor t
// owns blocks [first_t, first_{t+1}); empty tensors own no block.

// The tensor that owns block b: the last row whose first block is <= b (a binary search over a small,
// L1-resident table). COLS: the table's row width; FIRST: the column of the first block.
template <int COLS, int FIRST>
__device__ __forceinline__ int tile_owner(const long long* __restrict__ table, int n, long long b) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (table[COLS * mid + FIRST] <= b) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}
