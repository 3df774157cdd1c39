// kg_tma.h -- the Tensor Memory Accelerator of the CPU emulator: cp.async.bulk.tensor (tile mode,
// global -> shared, completing bytes on an mbarrier) over tensor maps that
// kernelgen.emulator.encode_tensor_map_tiled encodes (kernelgen/emulator/tensor_map.py packs
// TensorMapBlob), and the plain cp.async.bulk. Included by kg_ptx.h.
//
// A copy happens when it is issued: the box is read from global memory (elements outside the
// tensor are zero- or NaN-filled), written into shared memory densely in box order (innermost
// dimension first) with the map's swizzle applied to the shared addresses, then the whole box's
// bytes complete on the mbarrier. Each 16-byte chunk written is stamped with the mbarrier phase
// (kg_mbarrier.h: check_tma_read).
#ifndef KG_TMA_H
#define KG_TMA_H

#include <cstddef>

namespace kg_emu {

constexpr uint32_t kTensorMapMagic = 0x4D54474Bu;  // "KGTM"

struct TensorMapBlob {
  uint32_t magic;
  uint8_t elem_bytes, rank, swizzle, oob_nan, dtype, interleave, l2, pad0[5];
  uint64_t address;
  uint64_t dims[5];
  uint64_t strides[4];  // bytes, dims 1..rank-1
  uint16_t box[5];
  uint8_t elem_strides[5];
  uint8_t pad1[17];
};
static_assert(sizeof(TensorMapBlob) == 128 && offsetof(TensorMapBlob, address) == 16 &&
              offsetof(TensorMapBlob, strides) == 64 && offsetof(TensorMapBlob, box) == 96 &&
              offsetof(TensorMapBlob, elem_strides) == 106);

// CUtensorMapSwizzle (none, 32B, 64B, 128B) -> span in bytes.
inline uint32_t tma_swizzle_span(uint8_t code) { return code == 0 ? 0u : 16u << code; }

// The shared address where the byte at logical shared address `addr` of a swizzled tile lies:
// the 16-byte chunk index within a span (address bits 4.. up to the span) XOR the 128-byte row
// index within the pattern (bits 7.., minus `base_offset`), as the PTX ISA's Swizzle<B,4,3>.
// span 0: no swizzle.
inline uint32_t swizzle_address(uint32_t addr, uint32_t span, uint32_t base_offset = 0) {
  if (span == 0) return addr;
  const uint32_t mask = span / 16 - 1;  // 1, 3, 7
  const uint32_t row = ((addr >> 7) - base_offset) & mask;
  return addr ^ (row << 4);
}

inline const TensorMapBlob& tensor_map_at(const unsigned char* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 64 != 0) {
    trap_with("%s: tensor map address %p is not 64-byte aligned", what,
              static_cast<const void*>(p));
  }
  const TensorMapBlob& m = *reinterpret_cast<const TensorMapBlob*>(p);
  if (m.magic != kTensorMapMagic || m.rank < 1 || m.rank > 5) {
    trap_with("%s: %p is not a tensor map encoded by kernelgen.emulator.encode_tensor_map_tiled",
              what, static_cast<const void*>(p));
  }
  return m;
}

// Stamps the chunks [dst, dst + bytes) with the barrier phase their bytes complete on; a chunk
// whose previous TMA write has not completed yet is a hazard (two copies in flight into it).
inline void stamp_tma_chunks(const unsigned char* dst, uint32_t bytes, uint32_t slot,
                             uint32_t phase) {
  const Launch& L = *tctx.launch;
  const size_t first = chunk_of(dst), last = chunk_of(dst + bytes - 1);
  for (size_t c = first; c <= last; ++c) {
    const uint64_t old = L.chunk_tma[c].exchange((static_cast<uint64_t>(slot) + 1) << 32 | phase);
    if (old == 0) continue;
    const uint32_t old_slot = static_cast<uint32_t>(old >> 32) - 1u;
    const uint32_t old_phase = static_cast<uint32_t>(old);
    if (L.mbarriers[old_slot].phase.load() <= old_phase) {
      report_hazard("a TMA writes shared 0x%x while an earlier TMA write there (mbarrier at "
                    "shared 0x%x, phase %u) has not completed",
                    kSharedBase + static_cast<uint32_t>(c * 16), mbarrier_address(old_slot),
                    old_phase);
    }
  }
}

// Completes `bytes` on the barrier at `bar` after the copy wrote [dst, dst + bytes).
inline void tma_complete(uint32_t bar, const unsigned char* dst, uint32_t bytes, const char* what) {
  MbarrierLock lock;
  MbarrierState& b = mbarrier_initialized(bar, what);
  stamp_tma_chunks(dst, bytes, mbarrier_slot(bar, what), b.phase.load());
  mbarrier_complete_tx(b, bar, bytes);
  tctx.stats[kTmaBytes] += bytes;
}

namespace ptx {

// cp.async.bulk.tensor.<Rank>d.shared::cluster.global{.tile}.mbarrier::complete_tx::bytes
//   [dst], [tmap, {c0, ...}], [bar]
template <int Rank, class P, class... C>
inline void cp_async_bulk_tensor(uint32_t dst, P tmap, uint32_t bar, C... coords) {
  static_assert(sizeof...(C) == Rank && Rank >= 1 && Rank <= 5, "one coordinate per dimension");
  constexpr const char* what = "cp.async.bulk.tensor";
  const TensorMapBlob& m = tensor_map_at(global_ptr(tmap), what);
  if (m.rank != Rank) trap_with("%s.%dd: the tensor map has rank %u", what, Rank, m.rank);
  const int64_t start[5] = {static_cast<int64_t>(static_cast<int32_t>(coords))...};
  uint64_t count[5] = {1, 1, 1, 1, 1};
  uint64_t elements = 1;
  for (int i = 0; i < Rank; ++i) {
    count[i] = (m.box[i] + m.elem_strides[i] - 1u) / m.elem_strides[i];
    elements *= count[i];
  }
  const uint32_t esz = m.elem_bytes;
  const uint32_t bytes = static_cast<uint32_t>(elements * esz);
  if (m.elem_strides[0] != 1) {
    trap_with("%s: element stride %u in the innermost dimension (the emulator models strides "
              "of the outer dimensions only)", what, m.elem_strides[0]);
  }
  const uint32_t span = tma_swizzle_span(m.swizzle);
  if (span != 0 && m.box[0] * esz != span) {
    trap_with("%s: a swizzled box row of %u bytes (the emulator models rows of exactly the "
              "%u-byte swizzle span)", what, m.box[0] * esz, span);
  }
  unsigned char* d = shared_bytes(dst, bytes, 128, "cp.async.bulk.tensor destination");
  (void)d;
  const unsigned char* base = reinterpret_cast<const unsigned char*>(m.address);
  uint64_t idx[5] = {0, 0, 0, 0, 0};
  for (uint64_t e = 0; e < elements; ++e) {
    bool inside = true;
    uint64_t offset = 0;
    for (int i = 0; i < Rank; ++i) {
      const int64_t c = start[i] + static_cast<int64_t>(idx[i] * m.elem_strides[i]);
      inside = inside && c >= 0 && static_cast<uint64_t>(c) < m.dims[i];
      offset += static_cast<uint64_t>(c) * (i == 0 ? esz : m.strides[i - 1]);
    }
    const uint32_t at = swizzle_address(dst + static_cast<uint32_t>(e * esz), span);
    unsigned char* out = shared_bytes(at, esz, esz, "cp.async.bulk.tensor destination");
    if (inside) {
      std::memcpy(out, base + offset, esz);
    } else if (m.oob_nan) {
      const uint64_t nan = esz == 2 ? 0x7FFFu : esz == 4 ? 0x7FFFFFFFu : 0x7FFFFFFFFFFFFFFFull;
      std::memcpy(out, &nan, esz);
    } else {
      std::memset(out, 0, esz);
    }
    for (int i = 0; i < Rank && ++idx[i] == count[i]; ++i) idx[i] = 0;
  }
  tma_complete(bar, shared_bytes(dst, bytes, 1, what), bytes, what);
}

// cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], size, [bar]
template <class P>
inline void cp_async_bulk(uint32_t dst, P src, long long size, uint32_t bar) {
  constexpr const char* what = "cp.async.bulk";
  if (size <= 0 || size % 16 != 0 || size > kMbarrierMaxCount) {
    trap_with("%s: size %lld is not a positive multiple of 16", what, size);
  }
  const unsigned char* s = global_ptr(src);
  if (reinterpret_cast<uintptr_t>(s) % 16 != 0) {
    trap_with("%s: global source %p is not 16-byte aligned", what, static_cast<const void*>(s));
  }
  unsigned char* d = shared_bytes(dst, static_cast<uint32_t>(size), 16, "cp.async.bulk destination");
  std::memcpy(d, s, static_cast<size_t>(size));
  tma_complete(bar, d, static_cast<uint32_t>(size), what);
}

// prefetch.tensormap [tmap]: checks the map, no other effect.
template <class P>
inline void prefetch_tensormap(P tmap) {
  (void)tensor_map_at(global_ptr(tmap), "prefetch.tensormap");
}

}  // namespace ptx
}  // namespace kg_emu

#endif  // KG_TMA_H
