// kg_tma.h -- the Tensor Memory Accelerator of the CPU emulator: cp.async.bulk.tensor (tile mode)
// over tensor maps that kernelgen.emulator.encode_tensor_map_tiled encodes
// (kernelgen/emulator/tensor_map.py packs TensorMapBlob) and the plain cp.async.bulk, in both
// directions: global -> shared completing bytes on an mbarrier (multicast to several blocks of a
// cluster too), and shared -> global (stores and reductions) completing in bulk async-groups.
// Included by kg_ptx.h.
//
// Loads happen when they are issued: the box is read from global memory (elements outside the
// tensor are zero- or NaN-filled), written into shared memory densely in box order (innermost
// dimension first) with the map's swizzle applied to the shared addresses, then the whole box's
// bytes complete on the mbarrier. Each 16-byte chunk written is stamped with the mbarrier phase
// (kg_mbarrier.h: check_tma_read).
//
// Stores read their shared source at issue (through the same box order and swizzle) and keep
// the bytes; each chunk of the source is marked as read by a store in flight. The global memory
// is written only when a cp.async.bulk.wait_group (not .read) retires the store's group, or when
// the issuing thread leaves the kernel; a .read wait ends the read (leaving the kernel before
// one is a hazard: the shared memory is released): the source bytes
// must still be what the store read (compared), the chunks are released, and any write into
// them before that (stmatrix, cp.async, TMA load) is a hazard (kg_ptx.h: check_bulk_pending).
// Elements of the box outside the tensor are not written.
#ifndef KG_TMA_H
#define KG_TMA_H

#include <cstddef>
#include <deque>
#include <vector>

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

// TensorMapBlob::dtype (tensor_map.py: DATA_TYPES)
enum : uint8_t {
  kTmaU8 = 0, kTmaU16, kTmaU32, kTmaS32, kTmaU64, kTmaS64, kTmaF16, kTmaF32, kTmaF64, kTmaBf16
};

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

// The box a tensor instruction of rank `rank` moves at `start`: checks the map against what the
// emulator models and walks the elements in box order.
struct TmaBox {
  const TensorMapBlob* map = nullptr;
  int rank = 0;
  int64_t start[5] = {};
  uint64_t count[5] = {1, 1, 1, 1, 1};
  uint64_t elements = 1;
  uint32_t esz = 0, bytes = 0, span = 0;

  TmaBox() = default;
  TmaBox(const TensorMapBlob& m, int r, const int64_t* coords, const char* what)
      : map(&m), rank(r) {
    if (m.rank != r) trap_with("%s.%dd: the tensor map has rank %u", what, r, m.rank);
    for (int i = 0; i < 5; ++i) start[i] = i < r ? coords[i] : 0;
    for (int i = 0; i < r; ++i) {
      count[i] = (m.box[i] + m.elem_strides[i] - 1u) / m.elem_strides[i];
      elements *= count[i];
    }
    esz = m.elem_bytes;
    bytes = static_cast<uint32_t>(elements * esz);
    if (m.elem_strides[0] != 1) {
      trap_with("%s: element stride %u in the innermost dimension (the emulator models strides "
                "of the outer dimensions only)", what, m.elem_strides[0]);
    }
    span = tma_swizzle_span(m.swizzle);
    if (span != 0 && m.box[0] * esz != span) {
      trap_with("%s: a swizzled box row of %u bytes (the emulator models rows of exactly the "
                "%u-byte swizzle span)", what, m.box[0] * esz, span);
    }
  }

  // fn(e, inside, byte offset in the tensor) for every element e of the box, in box order.
  template <class F>
  void each(F&& fn) const {
    uint64_t idx[5] = {0, 0, 0, 0, 0};
    for (uint64_t e = 0; e < elements; ++e) {
      bool inside = true;
      uint64_t offset = 0;
      for (int i = 0; i < rank; ++i) {
        const int64_t c = start[i] + static_cast<int64_t>(idx[i] * map->elem_strides[i]);
        inside = inside && c >= 0 && static_cast<uint64_t>(c) < map->dims[i];
        offset += static_cast<uint64_t>(c) * (i == 0 ? esz : map->strides[i - 1]);
      }
      fn(e, inside, offset);
      for (int i = 0; i < rank && ++idx[i] == count[i]; ++i) idx[i] = 0;
    }
  }
};

// Stamps the chunks [dst, dst + bytes) of block C with the barrier phase their bytes complete
// on; a chunk whose previous TMA write has not completed yet is a hazard (two copies in flight
// into it), as is one a TMA store still reads.
inline void stamp_tma_chunks(Cta& C, const unsigned char* dst, uint32_t bytes, uint32_t slot,
                             uint32_t phase) {
  const size_t first = static_cast<size_t>(dst - C.smem) / 16;
  const size_t last = static_cast<size_t>(dst + bytes - 1 - C.smem) / 16;
  for (size_t c = first; c <= last; ++c) {
    if (&C == tctx().cta) check_bulk_pending(C.shadow[c], c, "a TMA load");
    const uint64_t old = C.shadow[c].tma.exchange((static_cast<uint64_t>(slot) + 1) << 32 | phase);
    if (old == 0) continue;
    const uint32_t old_slot = static_cast<uint32_t>(old >> 32) - 1u;
    const uint32_t old_phase = static_cast<uint32_t>(old) & ~kCpAsyncStamp;
    if (C.mbarriers[old_slot].phase.load() <= old_phase) {
      report_hazard("a TMA writes shared 0x%x while an earlier TMA or cp.async write there "
                    "(mbarrier at shared 0x%x, phase %u) has not completed",
                    chunk_address(c), mbarrier_address(old_slot), old_phase);
    }
  }
}

// Completes `bytes` on the barrier at .shared::cta address `bar` of block C after the copy wrote
// [dst, dst + bytes) there.
inline void tma_complete(Cta& C, uint32_t bar, const unsigned char* dst, uint32_t bytes,
                         const char* what) {
  MbarrierLock lock;
  MbarrierState& b = mbarrier_initialized_in(C, bar, what);
  stamp_tma_chunks(C, dst, bytes, mbarrier_slot_in(C, bar, what), b.phase.load());
  mbarrier_complete_tx(b, bar, bytes);
  tctx().stats[kTmaBytes] += bytes;
}

// The blocks a load writes: the block of the .shared::cluster destination (whose mbarrier must
// be in the same block), or with .multicast::cluster every block of `mask` at the same offsets.
struct TmaTargets {
  Cta* cta[kMaxClusterSize];
  int n = 0;
  uint32_t dst = 0, bar = 0;  // .shared::cta addresses in each
};
inline TmaTargets tma_targets(uint32_t dst, uint32_t bar, bool multicast, uint32_t mask,
                              const char* what) {
  TmaTargets t;
  const Launch& L = *tctx().launch;
  if (!multicast) {
    Cta& bc = cluster_target(bar, t.bar, what);
    Cta* dc = &cluster_target(dst, t.dst, what);
    if (dc != &bc) {
      trap_with("%s: the destination (shared::cluster 0x%x) and the mbarrier (0x%x) are in "
                "different blocks of the cluster", what, dst, bar);
    }
    t.cta[t.n++] = dc;
    return t;
  }
  if ((mask & 0xFFFFu) == 0 || (mask >> L.ncta) != 0) {
    trap_with("%s.multicast::cluster: ctaMask 0x%x names no block, or blocks outside the cluster "
              "of %u", what, mask, L.ncta);
  }
  t.dst = dst & ~kClusterRankMask;
  t.bar = bar & ~kClusterRankMask;
  for (uint32_t r = 0; r < L.ncta; ++r) {
    if ((mask >> r & 1u) == 0) continue;
    uint32_t unused;
    t.cta[t.n++] = &cluster_target((r + 1) << kClusterRankShift | t.dst, unused, what);
  }
  return t;
}

// ---- bulk async-groups of the stores (per thread) ---------------------------------------------
enum BulkKind : int { kBulkTensorStore, kBulkTensorReduce, kBulkStore, kBulkReduce };
enum BulkRedOp : int { kRedAdd, kRedMin, kRedMax };

struct BulkOp {
  int kind = kBulkTensorStore, red = kRedAdd;
  TmaBox box;                                         // tensor forms
  TensorMapBlob map{};                                // (box points here)
  unsigned char* gdst = nullptr;                      // plain forms
  uint8_t plain_type = kTmaU8;                        // plain reduce: element type
  uint32_t src = 0, bytes = 0, seq = 0;               // shared source, its bytes
  std::vector<unsigned char> data;                    // what the store read at issue
  bool read_done = false;
  BulkOp() = default;
  BulkOp(const BulkOp& o) { *this = o; }
  BulkOp& operator=(const BulkOp& o) {
    kind = o.kind;
    red = o.red;
    map = o.map;
    box = o.box;
    box.map = &map;
    gdst = o.gdst;
    plain_type = o.plain_type;
    src = o.src;
    bytes = o.bytes;
    seq = o.seq;
    data = o.data;
    read_done = o.read_done;
    return *this;
  }
};
struct BulkGroups {
  std::vector<BulkOp> current;              // issued since the last commit_group
  std::deque<std::vector<BulkOp>> committed;  // oldest first
  uint32_t next_seq = 0;
  void clear() {
    current.clear();
    committed.clear();
    next_seq = 0;
  }
};
inline BulkGroups& bulk_groups() { return fiber_local<BulkGroups, kLocalBulkGroups>(); }

// The shared byte offsets (from the block's smem) of a store's source, in the order of `data`.
template <class F>
inline void bulk_source_each(const BulkOp& op, F&& fn) {
  const unsigned char* base = tctx().cta->smem;
  if (op.kind == kBulkStore || op.kind == kBulkReduce) {
    const unsigned char* p = shared_bytes(op.src, op.bytes, 1, "cp.async.bulk source");
    for (uint32_t i = 0; i < op.bytes; ++i) fn(i, static_cast<size_t>(p - base) + i);
    return;
  }
  const uint32_t esz = op.box.esz;
  for (uint64_t e = 0; e < op.box.elements; ++e) {
    const uint32_t at = swizzle_address(op.src + static_cast<uint32_t>(e * esz), op.box.span);
    const unsigned char* p = shared_bytes(at, esz, esz, "cp.async.bulk.tensor source");
    for (uint32_t i = 0; i < esz; ++i) fn(e * esz + i, static_cast<size_t>(p - base) + i);
  }
}

inline uint64_t bulk_chunk_stamp(const BulkOp& op, bool pending) {
  return kStampValid | (pending ? kBulkPending : 0) | static_cast<uint64_t>(tctx().linear) << 40 |
         op.seq;
}

inline void bulk_issue(BulkOp& op, const char* what) {
  BulkGroups& g = bulk_groups();
  op.seq = g.next_seq++;
  op.data.resize(op.bytes);
  const unsigned char* base = tctx().cta->smem;
  size_t last_chunk = SIZE_MAX;
  bulk_source_each(op, [&](uint64_t i, size_t off) {
    op.data[i] = base[off];
    if (off / 16 != last_chunk) {
      last_chunk = off / 16;
      check_tma_read(last_chunk);
      check_async_read(last_chunk, what);
      check_cp_async_fenced(last_chunk, what);
    }
  });
  const size_t first = (op.src - kSharedBase) / 16, last = (op.src - kSharedBase + op.bytes - 1) / 16;
  for (size_t c = first; c <= last; ++c) tctx().cta->shadow[c].bulk.store(bulk_chunk_stamp(op, true));
  g.current.push_back(op);
}

// The store has read its source: it must still hold the bytes read at issue; the chunks are
// released at this thread's point.
inline void bulk_retire_read(BulkOp& op) {
  if (op.read_done) return;
  op.read_done = true;
  const unsigned char* base = tctx().cta->smem;
  bool changed = false;
  bulk_source_each(op, [&](uint64_t i, size_t off) { changed = changed || base[off] != op.data[i]; });
  if (changed) {
    report_hazard("shared memory a TMA store reads (source at 0x%x, %u bytes) changed between "
                  "its issue and the cp.async.bulk.wait_group.read that ends its read",
                  op.src, op.bytes);
  }
  const size_t first = (op.src - kSharedBase) / 16, last = (op.src - kSharedBase + op.bytes - 1) / 16;
  const uint64_t mine = bulk_chunk_stamp(op, true);
  for (size_t c = first; c <= last; ++c) {
    ChunkShadow& sh = tctx().cta->shadow[c];
    if (sh.bulk.load() != mine) continue;  // a later store of the chunk owns it
    sh.bulk_release.store(my_point());
    uint64_t expect = mine;
    sh.bulk.compare_exchange_strong(expect, bulk_chunk_stamp(op, false));
  }
}

template <class T>
inline void reduce_elem(unsigned char* dst, const unsigned char* src, int red) {
  T a, b;
  std::memcpy(&a, dst, sizeof(T));
  std::memcpy(&b, src, sizeof(T));
  T r = red == kRedAdd ? static_cast<T>(a + b) : red == kRedMin ? (b < a ? b : a) : (a < b ? b : a);
  std::memcpy(dst, &r, sizeof(T));
}
inline void reduce_16bit(unsigned char* dst, const unsigned char* src, int red, bool bf16) {
  uint16_t a, b;
  std::memcpy(&a, dst, 2);
  std::memcpy(&b, src, 2);
  const float x = bf16 ? bf16_bits_to_float(a) : half_bits_to_float(a);
  const float y = bf16 ? bf16_bits_to_float(b) : half_bits_to_float(b);
  const float r = red == kRedAdd ? x + y : red == kRedMin ? std::fmin(x, y) : std::fmax(x, y);
  const uint16_t out = bf16 ? float_to_bf16_bits(r) : float_to_half_bits(r);
  std::memcpy(dst, &out, 2);
}
// One element of a reduction (`type`: TensorMapBlob::dtype), under Launch::reduce_lock.
inline void reduce_element(unsigned char* dst, const unsigned char* src, uint8_t type, int red) {
  switch (type) {
    case kTmaF32: reduce_elem<float>(dst, src, red); break;
    case kTmaF64: reduce_elem<double>(dst, src, red); break;
    case kTmaF16: reduce_16bit(dst, src, red, false); break;
    case kTmaBf16: reduce_16bit(dst, src, red, true); break;
    case kTmaU32: reduce_elem<uint32_t>(dst, src, red); break;
    case kTmaS32: reduce_elem<int32_t>(dst, src, red); break;
    case kTmaU64: reduce_elem<uint64_t>(dst, src, red); break;
    case kTmaS64: reduce_elem<int64_t>(dst, src, red); break;
    default: trap_with("cp.reduce.async.bulk: element type %u cannot be reduced", type);
  }
}

// The store's global writes (its read ended first).
inline void bulk_retire_write(BulkOp& op) {
  bulk_retire_read(op);
  Launch& L = *tctx().launch;
  if (op.kind == kBulkStore) {
    std::memcpy(op.gdst, op.data.data(), op.bytes);
    return;
  }
  if (op.kind == kBulkReduce) {
    const uint32_t esz = op.plain_type == kTmaF16 || op.plain_type == kTmaBf16 ? 2
                         : op.plain_type == kTmaF64 || op.plain_type == kTmaU64 ? 8 : 4;
    pthread_mutex_lock(&L.reduce_lock);
    for (uint32_t i = 0; i < op.bytes; i += esz) {
      reduce_element(op.gdst + i, op.data.data() + i, op.plain_type, op.red);
    }
    pthread_mutex_unlock(&L.reduce_lock);
    return;
  }
  unsigned char* base = reinterpret_cast<unsigned char*>(op.map.address);
  const uint32_t esz = op.box.esz;
  const bool reduce = op.kind == kBulkTensorReduce;
  if (reduce) pthread_mutex_lock(&L.reduce_lock);
  op.box.each([&](uint64_t e, bool inside, uint64_t offset) {
    if (!inside) return;  // out-of-bounds elements of the box are not written
    if (reduce) {
      reduce_element(base + offset, op.data.data() + e * esz, op.map.dtype, op.red);
    } else {
      std::memcpy(base + offset, op.data.data() + e * esz, esz);
    }
  });
  if (reduce) pthread_mutex_unlock(&L.reduce_lock);
}

// Every store of the thread, when it leaves the kernel: read and written (the emulator writes
// the global results of stores never waited for; on the GPU they complete on their own). A
// store whose read no cp.async.bulk.wait_group{.read} ended is reported: the block's shared
// memory is released when its threads leave, while the store may still read it.
inline void bulk_thread_end() {
  BulkGroups& g = bulk_groups();
  size_t reading = 0;
  for (const auto& group : g.committed) {
    for (const BulkOp& op : group) reading += op.read_done ? 0 : 1;
  }
  reading += g.current.size();
  if (reading != 0) {
    report_hazard("the thread leaves the kernel with %zu TMA store(s) still reading shared "
                  "memory: no cp.async.bulk.wait_group.read (or wait_group) ended their read",
                  reading);
  }
  for (auto& group : g.committed) {
    for (BulkOp& op : group) bulk_retire_write(op);
  }
  for (BulkOp& op : g.current) bulk_retire_write(op);
  g.clear();
}

namespace ptx {

template <class P, class... C>
inline const TensorMapBlob& tma_map_and_coords(P tmap, const char* what, int64_t* start,
                                              C... coords) {
  const TensorMapBlob& m = tensor_map_at(global_ptr(tmap), what);
  const int64_t c[] = {static_cast<int64_t>(static_cast<int32_t>(coords))...};
  for (size_t i = 0; i < sizeof...(C); ++i) start[i] = c[i];
  return m;
}

// cp.async.bulk.tensor.<Rank>d.shared::{cluster,cta}.global{.tile}.mbarrier::complete_tx::bytes
//   {.multicast::cluster} [dst], [tmap, {c0, ...}], [bar]{, ctaMask}
template <int Rank, class P, class... C>
inline void cp_async_bulk_tensor_to(uint32_t dst, P tmap, uint32_t bar, bool multicast,
                                    uint32_t mask, C... coords) {
  static_assert(sizeof...(C) == Rank && Rank >= 1 && Rank <= 5, "one coordinate per dimension");
  constexpr const char* what = "cp.async.bulk.tensor";
  int64_t start[5] = {};
  const TensorMapBlob& m = tma_map_and_coords(tmap, what, start, coords...);
  const TmaBox box(m, Rank, start, what);
  const TmaTargets t = tma_targets(dst, bar, multicast, mask, what);
  for (int k = 0; k < t.n; ++k) {
    (void)cta_shared_bytes(*t.cta[k], t.dst, box.bytes, 128, "cp.async.bulk.tensor destination");
  }
  const unsigned char* base = reinterpret_cast<const unsigned char*>(m.address);
  const uint32_t esz = box.esz;
  box.each([&](uint64_t e, bool inside, uint64_t offset) {
    const uint32_t at = swizzle_address(t.dst + static_cast<uint32_t>(e * esz), box.span);
    for (int k = 0; k < t.n; ++k) {
      unsigned char* out =
          cta_shared_bytes(*t.cta[k], at, esz, esz, "cp.async.bulk.tensor destination");
      if (inside) {
        std::memcpy(out, base + offset, esz);
      } else if (m.oob_nan) {
        const uint64_t nan = esz == 2 ? 0x7FFFu : esz == 4 ? 0x7FFFFFFFu : 0x7FFFFFFFFFFFFFFFull;
        std::memcpy(out, &nan, esz);
      } else {
        std::memset(out, 0, esz);
      }
    }
  });
  for (int k = 0; k < t.n; ++k) {
    tma_complete(*t.cta[k], t.bar, cta_shared_bytes(*t.cta[k], t.dst, box.bytes, 1, what),
                 box.bytes, what);
  }
}
template <int Rank, class P, class... C>
inline void cp_async_bulk_tensor(uint32_t dst, P tmap, uint32_t bar, C... coords) {
  cp_async_bulk_tensor_to<Rank>(dst, tmap, bar, false, 0, coords...);
}
template <int Rank, class P, class... C>
inline void cp_async_bulk_tensor_multicast(uint32_t dst, P tmap, uint32_t bar, uint32_t mask,
                                           C... coords) {
  cp_async_bulk_tensor_to<Rank>(dst, tmap, bar, true, mask, coords...);
}

// cp.async.bulk.shared::{cluster,cta}.global.mbarrier::complete_tx::bytes{.multicast::cluster}
//   [dst], [src], size, [bar]{, ctaMask}
template <class P>
inline void cp_async_bulk_to(uint32_t dst, P src, long long size, uint32_t bar, bool multicast,
                             uint32_t mask) {
  constexpr const char* what = "cp.async.bulk";
  if (size <= 0 || size % 16 != 0 || size > kMbarrierMaxCount) {
    trap_with("%s: size %lld is not a positive multiple of 16", what, size);
  }
  const unsigned char* s = global_ptr(src);
  if (reinterpret_cast<uintptr_t>(s) % 16 != 0) {
    trap_with("%s: global source %p is not 16-byte aligned", what, static_cast<const void*>(s));
  }
  const TmaTargets t = tma_targets(dst, bar, multicast, mask, what);
  for (int k = 0; k < t.n; ++k) {
    unsigned char* d = cta_shared_bytes(*t.cta[k], t.dst, static_cast<uint32_t>(size), 16,
                                        "cp.async.bulk destination");
    std::memcpy(d, s, static_cast<size_t>(size));
    tma_complete(*t.cta[k], t.bar, d, static_cast<uint32_t>(size), what);
  }
}
template <class P>
inline void cp_async_bulk(uint32_t dst, P src, long long size, uint32_t bar) {
  cp_async_bulk_to(dst, src, size, bar, false, 0);
}
template <class P>
inline void cp_async_bulk_multicast(uint32_t dst, P src, long long size, uint32_t bar,
                                    uint32_t mask) {
  cp_async_bulk_to(dst, src, size, bar, true, mask);
}

// cp.async.bulk.tensor.<Rank>d.global.shared::cta{.tile}.bulk_group [tmap, {c0, ...}], [src]
// and cp.reduce.async.bulk.tensor.<Rank>d.global.shared::cta.<op>{.tile}.bulk_group (Red >= 0).
template <int Rank, int Red, class P, class... C>
inline void cp_async_bulk_tensor_store(P tmap, uint32_t src, C... coords) {
  static_assert(sizeof...(C) == Rank && Rank >= 1 && Rank <= 5, "one coordinate per dimension");
  const char* what = Red < 0 ? "cp.async.bulk.tensor store" : "cp.reduce.async.bulk.tensor";
  BulkOp op;
  int64_t start[5] = {};
  op.map = tma_map_and_coords(tmap, what, start, coords...);
  op.box = TmaBox(op.map, Rank, start, what);
  op.box.map = &op.map;
  op.kind = Red < 0 ? kBulkTensorStore : kBulkTensorReduce;
  op.red = Red < 0 ? kRedAdd : Red;
  if (Red >= 0 && op.map.dtype != kTmaF32 && op.map.dtype != kTmaF16 &&
      op.map.dtype != kTmaBf16 && op.map.dtype != kTmaF64 && op.map.dtype != kTmaU32 &&
      op.map.dtype != kTmaS32 && op.map.dtype != kTmaU64 && op.map.dtype != kTmaS64) {
    trap_with("%s: the tensor map's element type (code %u) is not one the emulator reduces", what,
              op.map.dtype);
  }
  op.src = src;
  op.bytes = op.box.bytes;
  (void)shared_bytes(src, op.bytes, 128, "cp.async.bulk.tensor source");
  bulk_issue(op, what);
}

// cp.async.bulk.global.shared::cta.bulk_group [dst], [src], size and
// cp.reduce.async.bulk.global.shared::cta.bulk_group.<op>.<type> (Red >= 0, Type its dtype code).
template <int Red, int Type, class P>
inline void cp_async_bulk_store(P dst, uint32_t src, long long size) {
  const char* what = Red < 0 ? "cp.async.bulk store" : "cp.reduce.async.bulk";
  if (size <= 0 || size % 16 != 0) {
    trap_with("%s: size %lld is not a positive multiple of 16", what, size);
  }
  unsigned char* d = const_cast<unsigned char*>(global_ptr(dst));
  if (reinterpret_cast<uintptr_t>(d) % 16 != 0) {
    trap_with("%s: global destination %p is not 16-byte aligned", what, static_cast<void*>(d));
  }
  BulkOp op;
  op.kind = Red < 0 ? kBulkStore : kBulkReduce;
  op.red = Red < 0 ? kRedAdd : Red;
  op.plain_type = static_cast<uint8_t>(Type);
  op.gdst = d;
  op.src = src;
  op.bytes = static_cast<uint32_t>(size);
  (void)shared_bytes(src, op.bytes, 16, "cp.async.bulk source");
  bulk_issue(op, what);
}

// cp.async.bulk.commit_group: the stores issued since the last one form a bulk async-group.
inline void cp_async_bulk_commit_group() {
  BulkGroups& g = bulk_groups();
  g.committed.push_back(std::move(g.current));
  g.current.clear();
}

// cp.async.bulk.wait_group{.read} N: all but the N most recent groups have read their sources
// (.read) or completed (their global writes done).
inline void cp_async_bulk_wait_group(long long n, bool read) {
  if (n < 0) trap_with("cp.async.bulk.wait_group %lld: negative count", n);
  BulkGroups& g = bulk_groups();
  if (read) {
    for (size_t i = 0; i + static_cast<size_t>(n) < g.committed.size(); ++i) {
      for (BulkOp& op : g.committed[i]) bulk_retire_read(op);
    }
    return;
  }
  while (static_cast<long long>(g.committed.size()) > n) {
    for (BulkOp& op : g.committed.front()) bulk_retire_write(op);
    g.committed.pop_front();
  }
}

// prefetch.tensormap [tmap]: checks the map, no other effect.
template <class P>
inline void prefetch_tensormap(P tmap) {
  (void)tensor_map_at(global_ptr(tmap), "prefetch.tensormap");
}

}  // namespace ptx
}  // namespace kg_emu

#endif  // KG_TMA_H
