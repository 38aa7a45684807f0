// 16-bit storage (bf16 and fp16 bits as unsigned short) and the one 16-byte store of 8 of them that the cast and
// the half-precision elementwise kernels share. Little-endian: the lower half of each word is the earlier element.
#pragma once

typedef unsigned short u16;

__device__ __forceinline__ void store8(u16* __restrict__ p, const u16 (&v)[8]) {
    uint4 a;
    a.x = (unsigned int)v[0] | ((unsigned int)v[1] << 16);
    a.y = (unsigned int)v[2] | ((unsigned int)v[3] << 16);
    a.z = (unsigned int)v[4] | ((unsigned int)v[5] << 16);
    a.w = (unsigned int)v[6] | ((unsigned int)v[7] << 16);
    *reinterpret_cast<uint4*>(p) = a;
}
