// kg_ptx.h -- the inline PTX that kernelgen kernels use, as C++ functions of the CPU emulator.
//
// Included by kg_emulator.h. The Python side (kernelgen/emulator/transform.py) rewrites every
// `asm(...)` statement of a kernel into a call of one of the functions below, with the asm
// operands in place of the %N references, so the functions mirror the PTX operand order:
//
//   ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16 -> ptx::ldmatrix<N, Trans>
//     (qualifiers in any order, e.g. CUTLASS's ldmatrix.sync.aligned.x4.m8n8.shared.b16)
//   mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 -> ptx::mma_m16n8k16<Elem>
//   cp.async.{ca,cg}.shared.global [dst], [src], size{, src-size}  -> ptx::cp_async<Size, Cg>
//   cp.async.commit_group / .wait_group N / .wait_all                -> ptx::cp_async_*
//   Hopper: wgmma.* (kg_wgmma.h), mbarrier.* (kg_mbarrier.h), cp.async.bulk{.tensor} loads and
//   stores, cp.reduce.async.bulk (kg_tma.h), bar / barrier (kg_barrier.h), barrier.cluster, mapa,
//   ld/st.shared::cluster, special registers (kg_cluster.h), stmatrix, cvt to and from fp8,
//   fence.proxy.async, elect.sync, setmaxnreg (below); the forms: docs/emulator.md
//
// Shared-memory addresses (what __cvta_generic_to_shared returns and ldmatrix/cp.async take)
// are byte offsets into the launch's dynamic shared memory plus kSharedBase. Errors (addresses
// outside the buffer, misalignment, bad sizes) trap: the launch raises RuntimeError.
#ifndef KG_PTX_H
#define KG_PTX_H

namespace kg_emu {

// Shared address of the first byte of dynamic shared memory. Nonzero so that 0 (a forgotten
// conversion) is not a valid address; a multiple of 1024 so that address bits used by swizzles
// match the offsets. The block's static __shared__ arena follows at kSharedBase +
// Cta::static_offset (1024-byte aligned, after a guard gap).
constexpr uint32_t kSharedBase = 0x400;

// What __cvta_generic_to_shared gives for a pointer outside the block's shared memory: on the
// GPU the conversion never faults (the result is meaningless), and code such as CUTLASS's
// converts addresses that lanes an ldmatrix .x1/.x2 ignores compute, so the emulator returns
// an address in [kOutsideShared, 2 kOutsideShared) that traps only when an instruction uses it,
// naming the conversion (each thread remembers its last such pointer).
constexpr uint32_t kOutsideShared = 0x80000000u;
struct LastOutsideCvta {
  const void* value = nullptr;
};
inline const void*& last_outside_cvta() {
  return fiber_local<LastOutsideCvta, kLocalLastOutsideCvta>().value;
}

// .shared::cluster addresses (kg_cluster.h: mapa): bits 24..27 hold the target block's
// %cluster_ctarank + 1 over its .shared::cta address; 0 there is the executing block's own
// shared memory (a .shared::cta address is a valid .shared::cluster address of its own block).
constexpr uint32_t kClusterRankShift = 24;
constexpr uint32_t kClusterRankMask = 0x0F000000u;

// Whether [c, c + bytes) lies in block C's dynamic shared memory or static arena.
inline bool in_shared_window(const Cta& C, const unsigned char* c, size_t bytes) {
  const unsigned char* st = C.static_smem();
  return (c >= C.smem && c + bytes <= C.smem + C.smem_bytes) ||
         (c >= st && c + bytes <= st + kStaticSmemBytes);
}

// The .shared-window address of a generic pointer into the block's dynamic shared memory or
// static arena (one-past-the-end included, as for any pointer); see kOutsideShared for others.
inline uint32_t shared_address_of(const void* p) {
  const Cta& C = *tctx().cta;
  const unsigned char* c = static_cast<const unsigned char*>(p);
  const unsigned char* st = C.static_smem();
  const bool dyn = c >= C.smem && c <= C.smem + C.smem_bytes;
  if (!dyn && !(c >= st && c <= st + kStaticSmemBytes)) {
    last_outside_cvta() = p;
    return kOutsideShared | (static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p)) & 0x0FFFFFF0u);
  }
  return kSharedBase + static_cast<uint32_t>(c - C.smem);
}

// Host pointer for `bytes` bytes at .shared::cta address `addr` of block C; traps unless they
// lie inside its dynamic shared memory or static arena and `addr` is a multiple of `align`.
// `lane` >= 0 names the lane that supplied the address (warp-collective instructions). The
// mbarrier instructions' own address (kg_mbarrier.h); every other access goes through
// cta_shared_bytes below.
inline unsigned char* cta_shared_span(const Cta& C, uint32_t addr, uint32_t bytes,
                                      uint32_t align, const char* what, int lane = -1) {
  const uint64_t offset = static_cast<uint64_t>(addr) - kSharedBase;
  const bool misaligned = addr % align != 0;
  const uint64_t so = C.static_offset;
  const bool dyn = addr >= kSharedBase && offset + bytes <= C.smem_bytes;
  // the static arena as far as static __shared__ declarations reserved it
  const uint64_t used = C.launch->static_used.load(std::memory_order_relaxed);
  const bool stat = addr >= kSharedBase && offset >= so && offset + bytes <= so + used;
  if (misaligned || !(dyn || stat)) {
    char from[32] = "";
    if (lane >= 0) snprintf(from, sizeof from, " (from lane %d)", lane);
    if ((addr & kOutsideShared) != 0 && (lane < 0 || static_cast<uint32_t>(lane) == tctx().lane)) {
      trap_with("%s: __cvta_generic_to_shared(%p)%s: not a pointer into the %zu bytes of dynamic "
                "shared memory or the static __shared__ variables of the block",
                what, last_outside_cvta(), from, C.smem_bytes);
    }
    if ((addr & kOutsideShared) != 0) {
      trap_with("%s: shared address 0x%x%s comes from __cvta_generic_to_shared of a pointer "
                "outside the %zu bytes of dynamic shared memory",
                what, addr, from, C.smem_bytes);
    }
    if ((addr & kClusterRankMask) != 0) {
      trap_with("%s: shared address 0x%x%s is a .shared::cluster address of block rank %u (from "
                "mapa): this access takes a .shared::cta address",
                what, addr, from, ((addr & kClusterRankMask) >> kClusterRankShift) - 1u);
    }
    if (misaligned) {
      trap_with("%s: shared address 0x%x%s is not %u-byte aligned", what, addr, from, align);
    }
    trap_with("%s: shared address 0x%x%s (+%u bytes) is outside the dynamic shared memory "
              "[0x%x, 0x%zx) and the static __shared__ variables [0x%zx, 0x%zx)",
              what, addr, from, bytes, kSharedBase, kSharedBase + C.smem_bytes,
              kSharedBase + C.static_offset,
              kSharedBase + C.static_offset + static_cast<size_t>(used));
  }
  return C.smem + offset;
}

// PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier": "Performing any
// non-mbarrier or mbarrier.init operations on an initialized mbarrier object results in undefined
// behavior". An access by any other instruction (st/ld.shared, cp.async, a TMA destination or
// source, ldmatrix, stmatrix, wgmma operands) to bytes [offset, offset + bytes) of block C that
// overlap a live mbarrier (mbarrier.init done, no mbarrier.inval since) is a hazard.
inline void check_no_live_mbarrier(const Cta& C, uint64_t offset, uint32_t bytes,
                                   const char* what, int lane) {
  if (bytes == 0) return;
  const uint64_t first = offset / 8, n = (offset + bytes - 1) / 8 - first + 1;
  const void* live = std::memchr(C.mbarrier_live + first, 1, n);
  if (live == nullptr) return;
  const uint64_t slot =
      static_cast<uint64_t>(static_cast<const unsigned char*>(live) - C.mbarrier_live);
  char from[48] = "";
  if (lane >= 0) snprintf(from, sizeof from, " (from lane %d)", lane);
  if (&C != tctx().cta) {
    const size_t n = std::strlen(from);
    snprintf(from + n, sizeof from - n, " of block rank %u", C.rank);
  }
  report_hazard("%s: shared 0x%llx (+%u bytes)%s overlaps the live mbarrier at shared 0x%llx "
                "(initialized, not invalidated): only mbarrier instructions may access an mbarrier "
                "object until mbarrier.inval", what,
                static_cast<unsigned long long>(kSharedBase + offset), bytes, from,
                static_cast<unsigned long long>(kSharedBase + 8 * slot));
}

inline unsigned char* cta_shared_bytes(const Cta& C, uint32_t addr, uint32_t bytes,
                                       uint32_t align, const char* what, int lane = -1) {
  unsigned char* p = cta_shared_span(C, addr, bytes, align, what, lane);
  check_no_live_mbarrier(C, static_cast<uint64_t>(p - C.smem), bytes, what, lane);
  return p;
}

// The same in the executing thread's block.
inline unsigned char* shared_bytes(uint32_t addr, uint32_t bytes, uint32_t align, const char* what,
                                   int lane = -1) {
  return cta_shared_bytes(*tctx().cta, addr, bytes, align, what, lane);
}

// The block of the cluster a .shared::cluster address names, and (in `cta_addr`) the
// .shared::cta address there; traps for a rank outside the cluster or a block that has exited.
inline Cta& cluster_target(uint32_t addr, uint32_t& cta_addr, const char* what) {
  const Launch& L = *tctx().launch;
  const uint32_t field = (addr & kClusterRankMask) >> kClusterRankShift;
  cta_addr = addr & ~kClusterRankMask;
  if (field == 0 || (addr & kOutsideShared) != 0) return *tctx().cta;
  if (field > L.ncta) {
    trap_with("%s: .shared::cluster address 0x%x names block rank %u of a cluster of %u", what,
              addr, field - 1u, L.ncta);
  }
  Cta& C = L.ctas[field - 1];
  if (&C != tctx().cta && C.running.load() == 0) {
    trap_with("%s: .shared::cluster address 0x%x is in block rank %u, whose threads have all "
              "exited (a block's shared memory lives only while it runs: barrier.cluster before "
              "leaving)", what, addr, field - 1u);
  }
  return C;
}

inline unsigned char* cluster_shared_bytes(uint32_t addr, uint32_t bytes, uint32_t align,
                                           const char* what, Cta** target = nullptr) {
  uint32_t cta_addr;
  Cta& C = cluster_target(addr, cta_addr, what);
  if (target != nullptr) *target = &C;
  return cta_shared_bytes(C, cta_addr, bytes, align, what);
}


// ---- shared-memory hazards between cp.async writes and ldmatrix reads ------------------------
// The emulator performs a cp.async only at its thread's wait, so a kernel that lets a copy land
// while another warp still reads the bytes could pass by luck of timing. Each 16-byte chunk of
// the dynamic shared memory records its last ldmatrix read and its last cp.async write, stamped
// with epochs (the __syncthreads a thread has passed: equal epochs of two threads mean no
// barrier orders them). Reported, naming the chunk:
//   * a cp.async and another warp's ldmatrix of the chunk at the same epoch, in either order (a
//     copy may land at any time after it is issued);
//   * an ldmatrix of a chunk whose copy has not been waited for (read of an in-flight copy);
//   * an ldmatrix of a chunk whose copy thread T waited for at epoch w, by another thread at an
//     epoch <= w (T's wait makes the bytes T's, a barrier makes them everyone's);
//   * a second copy into a chunk while the first is still in flight.
// Only 16-byte copies (a whole chunk) are tracked; 4- and 8-byte ones may share a chunk legally.
// Both sides publish their stamp before they look at the other's (sequentially consistent
// atomics), so of two conflicting accesses the later one always sees the earlier: a hazard is
// reported on every run, not by chance. Plain C++ loads and stores are not tracked.
//
// Read stamp: (epoch + 1) << 32 | warp (kManyWarps: several warps); 0: never read.
// Write stamp: (done + 1) << 40 | (issued + 1) << 16 | thread; done + 1 == 0 while in flight.
constexpr uint32_t kManyWarps = 0xFFFFFFFFu;
// A copy and another warp's ldmatrix of the same bytes after the same barrier, found by
// whichever of the two comes second (so the message does not depend on thread timing).
constexpr const char* kSameInterval =
    "after barrier %u a cp.async writes shared 0x%x and %s reads it by ldmatrix: a "
    "__syncthreads must separate the reads from the copy";

struct WriteStamp {
  uint32_t thread, issued, done;  // done == UINT32_MAX: in flight
  bool any;
  static WriteStamp of(uint64_t v) {
    return WriteStamp{static_cast<uint32_t>(v & 0xFFFF),
                      static_cast<uint32_t>((v >> 16) & 0xFFFFFF) - 1u,
                      static_cast<uint32_t>(v >> 40) - 1u, v != 0};
  }
  bool in_flight() const { return any && done == UINT32_MAX; }
};
inline uint64_t write_stamp(uint32_t thread, uint32_t issued, uint32_t done_plus_1) {
  return static_cast<uint64_t>(done_plus_1) << 40 | static_cast<uint64_t>(issued + 1) << 16 |
         thread;
}

inline size_t chunk_of(const unsigned char* host) {
  return static_cast<size_t>(host - tctx().cta->smem) / 16;
}

// ---- stmatrix writes and the reads that must come after them ----------------------------------
// stmatrix and st.shared (kg_cluster.h) write shared memory through the generic proxy. Each
// 16-byte chunk they write records the writer and its point (epoch and barrier arrivals,
// kg_emulator.h: hb_after), and the writer's next fence.proxy.async.shared::cta records its
// point beside it. Reported:
//   * an ldmatrix of the chunk by a thread of another warp that no barrier orders after the
//     write, or a write no barrier orders after the chunk's last ldmatrix by another warp (the
//     same warp's stmatrix and ldmatrix meet in the warp-synchronous instructions);
//   * an async-proxy read of it (a TMA store, a wgmma operand) that the writer's
//     fence.proxy.async after the write is not ordered before: no fence, or no barrier;
//   * a write (stmatrix, cp.async, TMA) into a chunk a TMA store still reads (kg_bulk.h: before
//     the issuing thread's cp.async.bulk.wait_group.read, or not ordered after it).
// Plain C++ stores are not tracked (a TMA store compares its source at the wait instead).
constexpr uint64_t kStampValid = uint64_t{1} << 63;
constexpr uint32_t kStampField = (1u << 26) - 1u;

struct PointStamp {  // a thread's point: bit 63 valid, thread << 52, epoch << 26, arrivals
  bool any;
  uint32_t thread, epoch, arrivals;
  static PointStamp of(uint64_t v) {
    return PointStamp{(v & kStampValid) != 0, static_cast<uint32_t>(v >> 52) & 0x7FFu,
                      static_cast<uint32_t>(v >> 26) & kStampField,
                      static_cast<uint32_t>(v) & kStampField};
  }
  bool before_me() const { return any && hb_after(thread, epoch, arrivals); }
};
inline uint64_t my_point() {
  return kStampValid | static_cast<uint64_t>(tctx().linear) << 52 |
         static_cast<uint64_t>(tctx().epoch & kStampField) << 26 | (hb().arrivals & kStampField);
}

// Chunks this thread wrote by stmatrix or st.shared since its last fence.proxy.async.
struct UnfencedChunks {
  std::vector<uint32_t> value;
};
inline std::vector<uint32_t>& unfenced_chunks() {
  return fiber_local<UnfencedChunks, kLocalUnfencedChunks>().value;
}

inline uint32_t chunk_address(size_t chunk) { return kSharedBase + static_cast<uint32_t>(chunk * 16); }

// Bulk-store stamp (kg_bulk.h): bit 63 valid, bit 62 the read is pending, thread << 40, the
// store's number; bulk_release: the issuing thread's point at the wait that ended the read.
constexpr uint64_t kBulkPending = uint64_t{1} << 62;

// A write into the chunk by this thread: a TMA store that reads it must be done reading.
inline void check_bulk_pending(const ChunkShadow& sh, size_t chunk, const char* what) {
  const uint64_t b = sh.bulk.load();
  if (b == 0) return;
  const uint32_t thread = static_cast<uint32_t>(b >> 40) & 0x7FFu;
  if ((b & kBulkPending) != 0) {
    report_hazard("%s writes shared 0x%x while a TMA store of thread %u still reads it: wait for "
                  "the store's bulk async-group with cp.async.bulk.wait_group.read first",
                  what, chunk_address(chunk), thread);
  } else if (!PointStamp::of(sh.bulk_release.load()).before_me()) {
    report_hazard("%s writes shared 0x%x, which a TMA store of thread %u read: no barrier orders "
                  "that thread's cp.async.bulk.wait_group.read before the write",
                  what, chunk_address(chunk), thread);
  }
}

// stmatrix (a lane's 16-byte row at `host`) writes the chunk.
// A write and a read of another warp that no barrier orders, found by whichever comes second
// (the message does not depend on thread timing).
constexpr const char* kUnorderedStmatrix =
    "thread %u writes (stmatrix, st.shared) and thread %u reads (ldmatrix, ld.shared) shared "
    "0x%x with no barrier ordering them";

// Published before the last ldmatrix reader is checked (and the reader publishes before it
// checks this write), so of a write and a read no barrier orders, the later one sees the other.
inline void note_generic_write(const unsigned char* host, const char* what) {
  const size_t chunk = chunk_of(host);
  ChunkShadow& sh = tctx().cta->shadow[chunk];
  sh.fence.store(0);
  sh.gen.store(my_point());
  unfenced_chunks().push_back(static_cast<uint32_t>(chunk));
  check_bulk_pending(sh, chunk, what);
  const PointStamp r = PointStamp::of(sh.reader.load());
  if (r.any && r.thread / 32 != tctx().linear / 32 && !r.before_me()) {
    report_hazard(kUnorderedStmatrix, tctx().linear, r.thread, chunk_address(chunk));
  }
}

// fence.proxy.async{.shared::cta}: this thread's stmatrix and st.shared writes reach the async
// proxy.
inline void fence_generic_writes() {
  ChunkShadow* shadow = tctx().cta->shadow;
  for (uint32_t chunk : unfenced_chunks()) {
    const PointStamp w = PointStamp::of(shadow[chunk].gen.load());
    if (w.any && w.thread == tctx().linear) shadow[chunk].fence.store(my_point());
  }
  unfenced_chunks().clear();
}

// A generic-proxy read (ldmatrix) of a chunk stmatrix wrote.
inline void check_generic_write(const ChunkShadow& sh, size_t chunk) {
  const PointStamp w = PointStamp::of(sh.gen.load());
  if (!w.any || w.thread / 32 == tctx().linear / 32 || w.before_me()) return;
  report_hazard(kUnorderedStmatrix, w.thread, tctx().linear, chunk_address(chunk));
}

// An async-proxy read (TMA store, wgmma) of chunk `chunk` of the executing thread's block.
inline void check_async_read(size_t chunk, const char* what) {
  const ChunkShadow& sh = tctx().cta->shadow[chunk];
  const PointStamp w = PointStamp::of(sh.gen.load());
  if (!w.any || PointStamp::of(sh.fence.load()).before_me()) return;
  if (w.before_me()) {
    report_hazard("%s reads shared 0x%x, which thread %u wrote by stmatrix or st.shared with no "
                  "fence.proxy.async after the write (generic-proxy writes reach the async "
                  "proxy only through that fence)",
                  what, chunk_address(chunk), w.thread);
  } else {
    report_hazard("%s reads shared 0x%x, which thread %u wrote by stmatrix or st.shared, with "
                  "no barrier ordering the write and its fence.proxy.async before the read",
                  what, chunk_address(chunk), w.thread);
  }
}


// An ldmatrix lane reads the 16-byte row at `host`.
// `generic`: an ldmatrix (else a wgmma operand, an async-proxy read: check_async_read).
inline void note_shared_read(const unsigned char* host, bool generic = true) {
  ChunkShadow& sh = tctx().cta->shadow[chunk_of(host)];
  const size_t chunk = chunk_of(host);
  const uint32_t warp = tctx().linear / 32, epoch = tctx().epoch;
  const uint64_t mine = static_cast<uint64_t>(epoch + 1) << 32 | warp;
  uint64_t old = sh.reads.load();
  // The epoch model of reads against later cp.async issues is ldmatrix's (__syncthreads orders
  // them); a wgmma's reads are ordered against the next copy by mbarriers, as TMA's are.
  while (generic) {
    uint64_t want = mine;
    if ((old >> 32) == epoch + 1u && static_cast<uint32_t>(old) != warp) want = mine | kManyWarps;
    if (old == want || sh.reads.compare_exchange_weak(old, want)) break;
  }
  if (generic) {
    sh.reader.store(my_point());
    check_generic_write(sh, chunk);
  } else {
    check_async_read(chunk, "wgmma");
  }
  const WriteStamp w = WriteStamp::of(sh.writes.load());
  if (!w.any) return;
  const uint32_t addr = kSharedBase + static_cast<uint32_t>(chunk * 16);
  if (w.thread / 32 != warp && w.issued == epoch) {  // either order: the same race
    report_hazard(kSameInterval, epoch, addr, "another warp");
  } else if (w.in_flight()) {
    report_hazard("ldmatrix reads shared 0x%x while its cp.async (thread %u, issued after "
                 "barrier %u) is in flight: wait for the copy, then __syncthreads",
                 addr, w.thread, w.issued);
  } else if (w.thread != tctx().linear && epoch <= w.done) {
    report_hazard("ldmatrix reads shared 0x%x after barrier %u, but thread %u waited for its "
                 "cp.async there only after barrier %u: no __syncthreads orders the two",
                 addr, epoch, w.thread, w.done);
  }
}

// A cp.async is issued into the chunk at `host`.
inline void note_async_write(const unsigned char* host) {
  const size_t chunk = chunk_of(host);
  ChunkShadow& sh = tctx().cta->shadow[chunk];
  const uint32_t epoch = tctx().epoch, warp = tctx().linear / 32;
  const WriteStamp before =
      WriteStamp::of(sh.writes.exchange(write_stamp(tctx().linear, epoch, 0)));
  const uint64_t read = sh.reads.load();
  check_bulk_pending(sh, chunk, "cp.async");
  const uint32_t addr = kSharedBase + static_cast<uint32_t>(chunk * 16);
  if (before.in_flight()) {
    report_hazard("cp.async into shared 0x%x while thread %u's copy there (issued after barrier "
                 "%u) is still in flight",
                 addr, before.thread, before.issued);
  } else if ((read >> 32) == epoch + 1u && static_cast<uint32_t>(read) != warp) {
    report_hazard(kSameInterval, epoch, addr,
                  static_cast<uint32_t>(read) == kManyWarps ? "several warps" : "another warp");
  }
}

// The issuing thread's wait performed its copy into the chunk at `host`.
inline void note_async_done(const unsigned char* host) {
  std::atomic<uint64_t>& writes = tctx().cta->shadow[chunk_of(host)].writes;
  uint64_t old = writes.load();
  for (;;) {
    const WriteStamp w = WriteStamp::of(old);
    if (!w.in_flight() || w.thread != tctx().linear) return;  // a later copy replaced it
    if (writes.compare_exchange_weak(
            old, write_stamp(w.thread, w.issued, tctx().epoch + 1)))
      return;
  }
}

// ---- shared-memory bank conflicts of ldmatrix ----------------------------------------------
// Shared memory has 32 banks of 4 bytes. An ldmatrix reads one 8x8 matrix (8 rows of 16 bytes,
// 128 bytes) per wavefront when its 8 rows fall in 8 different 16-byte bank groups (address / 16
// mod 8); rows at equal addresses are one read (broadcast). Otherwise the matrix takes as many
// wavefronts as the most-used group has distinct rows. Called by one lane per instruction with
// the 8 * N row addresses.
template <int N>
inline void note_ldmatrix_banks(const uint64_t* rows) {
  ThreadCtx& c = tctx();
  uint32_t wavefronts = 0;
  for (int m = 0; m < N; ++m) {
    const uint64_t* mat = rows + 8 * m;
    uint32_t worst = 0;
    for (int i = 0; i < 8; ++i) {
      uint32_t distinct = 0;  // rows of i's bank group, counted at their first occurrence
      for (int j = 0; j < 8; ++j) {
        if ((mat[j] / 16) % 8 != (mat[i] / 16) % 8) continue;
        bool seen = false;
        for (int k = 0; k < j; ++k) seen = seen || mat[k] == mat[j];
        distinct += seen ? 0u : 1u;
      }
      worst = distinct > worst ? distinct : worst;
    }
    wavefronts += worst;
    if (worst > 1 && c.launch->conflict_noted.exchange(1) == 0) {
      char* out = c.launch->first_conflict;
      const size_t len = sizeof c.launch->first_conflict;
      int used = snprintf(out, len, "ldmatrix.x%d in block (%u,%u,%u) warp %u: matrix %d takes %u "
                          "wavefronts, rows at", N, blockIdx.x, blockIdx.y, blockIdx.z,
                          c.linear / 32, m, worst);
      for (int j = 0; j < 8 && used > 0 && static_cast<size_t>(used) < len; ++j) {
        used += snprintf(out + used, len - static_cast<size_t>(used), " 0x%x",
                         static_cast<uint32_t>(mat[j]));
      }
    }
  }
  c.stats[kLdmatrix] += 1;
  c.stats[kLdmatrixWavefronts] += wavefronts;
  c.stats[kLdmatrixIdeal] += N;
}

}  // namespace kg_emu

#include "kg_mbarrier.h"
#include "kg_barrier.h"
#include "kg_cluster.h"

inline size_t __cvta_generic_to_shared(const void* p) { return kg_emu::shared_address_of(p); }
inline void* __cvta_shared_to_generic(size_t addr) {
  return kg_emu::shared_bytes(static_cast<uint32_t>(addr), 0, 1, "__cvta_shared_to_generic");
}

namespace kg_emu::ptx {

// cvta.to.shared: the same mapping as __cvta_generic_to_shared.
inline uint32_t shared_address_of(const void* p) { return ::kg_emu::shared_address_of(p); }

// ---- operand conversions (a "r" operand is any 32-bit value, passed as its bits) -------------
template <class V>
inline uint32_t b32(const V& v) {
  if constexpr (std::is_integral_v<V> || std::is_enum_v<V>) {
    return static_cast<uint32_t>(v);  // like a "r" operand: narrower values widen, wider truncate
  } else {
    static_assert(sizeof(V) == 4 && std::is_trivially_copyable_v<V>, "\"r\" operand type");
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
  }
}
template <class R>
inline void set_b32(R& r, uint32_t v) {
  static_assert(sizeof(R) == 4 && std::is_trivially_copyable_v<R>, "\"=r\" operand type");
  std::memcpy(&r, &v, 4);
}
// A "=l" destination: any 64-bit object that receives the bits.
template <class R>
inline void set_b64(R& r, uint64_t v) {
  static_assert(sizeof(R) == 8 && std::is_trivially_copyable_v<R>, "\"=l\" operand type");
  std::memcpy(&r, &v, 8);
}
// A 64-bit source ("l" or "d"): its bits.
template <class V>
inline uint64_t b64(const V& v) {
  if constexpr (std::is_integral_v<V> || std::is_enum_v<V>) {
    return static_cast<uint64_t>(v);
  } else {
    static_assert(sizeof(V) == 8 && std::is_trivially_copyable_v<V>, "\"l\" operand type");
    uint64_t u;
    std::memcpy(&u, &v, 8);
    return u;
  }
}

// ld.shared{::cta,::cluster}{.vN}.<32- or 64-bit type> {d...}, [addr] and st ... [addr], {v...}
// (kg_cluster.h: ld_shared / st_shared), the vector aligned to its whole size.
template <class T, class... D>
inline void ld_shared_v(uint32_t addr, bool cluster, const char* what, D&... d) {
  constexpr uint32_t n = sizeof...(D);
  if (addr % (n * sizeof(T)) != 0) {
    trap_with("%s: shared address 0x%x is not %zu-byte aligned", what, addr, n * sizeof(T));
  }
  uint32_t i = 0;
  auto one = [&](auto& dest) {
    const T v = ld_shared<T>(addr + static_cast<uint32_t>(sizeof(T)) * i++, cluster, what);
    if constexpr (sizeof(T) == 8) {
      set_b64(dest, v);
    } else {
      set_b32(dest, v);
    }
  };
  (one(d), ...);
}
template <class T, class... V>
inline void st_shared_v(uint32_t addr, bool cluster, const char* what, V... v) {
  constexpr uint32_t n = sizeof...(V);
  if (addr % (n * sizeof(T)) != 0) {
    trap_with("%s: shared address 0x%x is not %zu-byte aligned", what, addr, n * sizeof(T));
  }
  uint32_t i = 0;
  (st_shared<T>(addr + static_cast<uint32_t>(sizeof(T)) * i++, static_cast<T>(v), cluster, what),
   ...);
}

// An f32 operand given as "r": the 32-bit value holds the float's bits (as in a PTX .b32/.f32
// register), e.g. CUTLASS-style accumulators in uint32_t arrays.
template <class V>
inline float f32_bits(const V& v) {
  const uint32_t u = b32(v);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// An f32 destination: a float ("=f"), or any 32-bit object that receives the bits ("=r").
template <class R>
inline void set_f32(R& r, float v) {
  if constexpr (std::is_same_v<R, float>) {
    r = v;
  } else {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    set_b32(r, u);
  }
}
// A "l" global address: a pointer, or a 64-bit integer holding one.
template <class P>
inline const unsigned char* global_ptr(P p) {
  if constexpr (std::is_pointer_v<P>) {
    return reinterpret_cast<const unsigned char*>(p);
  } else {
    static_assert(std::is_integral_v<P> && sizeof(P) == 8, "\"l\" operand type");
    return reinterpret_cast<const unsigned char*>(static_cast<uintptr_t>(p));
  }
}

// ---- ldmatrix.sync.aligned.m8n8.xN{.trans}.shared.b16 ----------------------------------------
// N 8x8 matrices of 16-bit elements; lanes 8i..8i+7 give the (16-byte aligned) addresses of rows
// 0..7 of matrix i. Lane l receives one register per matrix: elements (row l/4, cols 2(l%4) and
// 2(l%4)+1), the lower column in the low half; with .trans the transposed matrix, i.e. elements
// (rows 2(l%4) and 2(l%4)+1, col l/4). Warp-collective: every lane publishes its address, warp
// barrier, each lane reads what it receives, warp barrier (so shared memory is read while all
// lanes are inside the instruction, as on the GPU).
template <int N, bool Trans, class... R>
inline void ldmatrix(uint32_t addr, R&... regs) {
  static_assert(N == 1 || N == 2 || N == 4, "ldmatrix .x1, .x2 or .x4");
  static_assert(sizeof...(R) == N, "one destination register per matrix");
  ThreadCtx& c = tctx();
  Warp& w = *c.warp;
  uint64_t* slots = w.slots[c.parity];  // same double buffering as kg_emu::warp_exchange
  c.parity ^= 1u;
  slots[c.lane] = addr;
  w.bar.arrive_and_wait();
  // Every lane checks all row addresses, so a bad one traps deterministically.
  const unsigned char* rows[8 * N];
  for (int i = 0; i < 8 * N; ++i) {
    rows[i] = shared_bytes(static_cast<uint32_t>(slots[i]), 16, 16, "ldmatrix row", i);
  }
  if (c.lane < 8 * N) {  // each row once, by the lane naming it
    note_shared_read(rows[c.lane]);
    check_tma_read(chunk_of(rows[c.lane]));
  }
  if (c.lane == 0) note_ldmatrix_banks<N>(slots);
  const uint32_t l = c.lane;
  uint32_t out[N];
  for (int m = 0; m < N; ++m) {
    const unsigned char* const* mat = rows + 8 * m;
    if constexpr (!Trans) {
      std::memcpy(&out[m], mat[l / 4] + 4 * (l % 4), 4);
    } else {
      uint16_t lo, hi;
      std::memcpy(&lo, mat[2 * (l % 4)] + 2 * (l / 4), 2);
      std::memcpy(&hi, mat[2 * (l % 4) + 1] + 2 * (l / 4), 2);
      out[m] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
  }
  w.bar.arrive_and_wait();
  int k = 0;
  (set_b32(regs, out[k++]), ...);
}

// ---- stmatrix.sync.aligned.m8n8.xN{.trans}.shared{::cta}.b16 -----------------------------------
// The inverse of ldmatrix: lanes 8i..8i+7 give the (16-byte aligned) addresses of rows 0..7 of
// matrix i, and lane l holds, in its register for matrix i, elements (row l/4, cols 2(l%4) and
// 2(l%4)+1), the lower column in the low half; with .trans the transposed matrix, i.e. elements
// (rows 2(l%4) and 2(l%4)+1, col l/4). So memory row r, column c of matrix i comes from lane
// 4r + c/2 (half c%2), with .trans from lane 4c + r/2 (half r%2). Warp-collective like ldmatrix:
// every lane publishes its address and registers, warp barrier, the lane naming a row writes it
// (a generic-proxy write the race check records), warp barrier.
template <int N, bool Trans, class... R>
inline void stmatrix(uint32_t addr, const R&... regs) {
  static_assert(N == 1 || N == 2 || N == 4, "stmatrix .x1, .x2 or .x4");
  static_assert(sizeof...(R) == N, "one source register per matrix");
  ThreadCtx& c = tctx();
  Warp& w = *c.warp;
  uint64_t* slots = w.slots[c.parity];  // same double buffering as kg_emu::warp_exchange
  uint32_t(*frags)[6] = w.frags[c.parity];
  c.parity ^= 1u;
  slots[c.lane] = addr;
  const uint32_t mine[N] = {b32(regs)...};
  std::memcpy(frags[c.lane], mine, sizeof mine);
  w.bar.arrive_and_wait();
  unsigned char* rows[8 * N];
  for (int i = 0; i < 8 * N; ++i) {
    rows[i] = shared_bytes(static_cast<uint32_t>(slots[i]), 16, 16, "stmatrix row", i);
  }
  if (c.lane < 8 * N) {
    const int m = static_cast<int>(c.lane / 8), r = static_cast<int>(c.lane % 8);
    uint16_t row[8];
    for (int col = 0; col < 8; ++col) {
      const uint32_t src = Trans ? 4 * col + r / 2 : 4 * r + col / 2;
      const int high = Trans ? r % 2 : col % 2;
      row[col] = static_cast<uint16_t>(high ? frags[src][m] >> 16 : frags[src][m] & 0xFFFFu);
    }
    note_generic_write(rows[c.lane], "stmatrix");
    std::memcpy(rows[c.lane], row, 16);
  }
  w.bar.arrive_and_wait();
}

// ---- mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32 (T = f16 or bf16) -------------------------
// D (16x8) = A (16x16) * B (16x8) + C, g = lane / 4, t = lane % 4, two 16-bit values per register
// (the lower column / row in the low half):
//   a0 = A[g][2t..2t+1]   a1 = A[g+8][2t..2t+1]   a2 = A[g][2t+8..2t+9]   a3 = A[g+8][2t+8..2t+9]
//   b0 = B[2t..2t+1][g]   b1 = B[2t+8..2t+9][g]
//   c0/d0 = [g][2t]   c1/d1 = [g][2t+1]   c2/d2 = [g+8][2t]   c3/d3 = [g+8][2t+1]
// A lane's C and D elements coincide, so only the A and B fragments are exchanged.
//
// Arithmetic: every product of two 16-bit floats is exact in double; the 16 products are summed
// in double (exact unless their magnitudes span more than ~53 bits), C is added in double and the
// result is rounded once to fp32 (round-to-nearest-even). The tensor cores differ slightly: they
// align the products to the largest exponent with a limited number of bits and truncate, so
// results can differ in the last bits of the fp32 mantissa. Compare with tolerances.
enum class Elem { f16, bf16 };

template <Elem E>
inline double elem_to_double(uint32_t reg, int high) {
  const uint16_t bits = static_cast<uint16_t>(high ? reg >> 16 : reg & 0xffffu);
  if constexpr (E == Elem::f16) {
    return static_cast<double>(half_bits_to_float(bits));
  } else {
    return static_cast<double>(bf16_bits_to_float(bits));
  }
}

// D0..D3: float ("=f"/"+f") or 32-bit integers holding the bits ("=r"/"+r").
template <Elem E, class D0, class D1, class D2, class D3>
inline void mma_m16n8k16(D0& d0, D1& d1, D2& d2, D3& d3, uint32_t a0, uint32_t a1, uint32_t a2,
                         uint32_t a3, uint32_t b0, uint32_t b1, float c0, float c1, float c2,
                         float c3) {
  ThreadCtx& c = tctx();
  Warp& w = *c.warp;
  uint32_t(*frags)[6] = w.frags[c.parity];  // [lane][a0 a1 a2 a3 b0 b1]
  c.parity ^= 1u;
  const uint32_t mine[6] = {a0, a1, a2, a3, b0, b1};
  std::memcpy(frags[c.lane], mine, sizeof mine);
  w.bar.arrive_and_wait();
  // A[row][k] lives in lane 4 (row % 8) + (k % 8) / 2, register (row >= 8) + 2 (k >= 8).
  auto A = [&](int row, int k) {
    return elem_to_double<E>(frags[4 * (row % 8) + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k & 1);
  };
  // B[k][n] lives in lane 4 n + (k % 8) / 2, register b0 (k < 8) or b1 (k >= 8).
  auto B = [&](int k, int n) {
    return elem_to_double<E>(frags[4 * n + (k % 8) / 2][4 + (k >= 8)], k & 1);
  };
  const int g = static_cast<int>(c.lane / 4), t = static_cast<int>(c.lane % 4);
  auto dot = [&](int row, int col, float acc) {
    double s = 0.0;
    for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
    return static_cast<float>(s + static_cast<double>(acc));
  };
  const float r0 = dot(g, 2 * t, c0), r1 = dot(g, 2 * t + 1, c1);
  const float r2 = dot(g + 8, 2 * t, c2), r3 = dot(g + 8, 2 * t + 1, c3);
  set_f32(d0, r0);
  set_f32(d1, r1);
  set_f32(d2, r2);
  set_f32(d3, r3);
}

// ---- cp.async -----------------------------------------------------------------------------------
// Asynchronous model: cp.async only validates and queues the copy in the thread's current
// (uncommitted) group; nothing is read or written. commit_group closes the current group (empty
// groups are fine). wait_group N performs, oldest first, every copy of all committed groups but
// the N most recent ones; wait_all performs every queued copy, uncommitted ones included. Only
// then do the bytes appear in shared memory (and is global memory read). Copies still queued
// when the thread leaves the kernel are dropped.
// Cg: the .cg form, which copies 16 bytes only (checked here when the size is an "n" operand).
template <int CpSize, bool Cg = false, class P, class S>
inline void cp_async(uint32_t dst, P src, S src_size_operand) {
  static_assert(CpSize == 4 || CpSize == 8 || CpSize == 16, "cp.async cp-size is 4, 8 or 16");
  static_assert(!Cg || CpSize == 16, "cp.async.cg copies 16 bytes (cp-size 16)");
  const long long src_size = static_cast<long long>(src_size_operand);
  if (src_size < 0 || src_size > CpSize) {
    trap_with("cp.async: src-size %lld outside [0, %d]", src_size, CpSize);
  }
  unsigned char* d = shared_bytes(dst, CpSize, CpSize, "cp.async destination");
  const unsigned char* s = global_ptr(src);
  if (src_size > 0 && reinterpret_cast<uintptr_t>(s) % CpSize != 0) {
    trap_with("cp.async: global source %p is not %d-byte aligned", static_cast<const void*>(s),
              CpSize);
  }
  if (CpSize == 16) note_async_write(d);
  tctx().stats[kCpAsyncGlobalBytes] += static_cast<uint64_t>(src_size);
  const Launch& L = *tctx().launch;
  const uint64_t at = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(s));
  for (int i = 0; i < L.nranges; ++i) {
    if (L.ranges[2 * i] <= at && at < L.ranges[2 * i + 1]) {
      tctx().arg_copies[i] += 1;
      tctx().arg_bytes[i] += static_cast<uint64_t>(src_size);
      break;
    }
  }
  async_copies().current.push_back(
      PendingCopy{d, s, static_cast<uint32_t>(CpSize), static_cast<uint32_t>(src_size)});
}
template <int CpSize, bool Cg = false, class P>
inline void cp_async(uint32_t dst, P src) {
  cp_async<CpSize, Cg>(dst, src, CpSize);
}

inline void perform(const PendingCopy& c) {
  if (c.src_size > 0) std::memcpy(c.dst, c.src, c.src_size);
  std::memset(c.dst + c.src_size, 0, c.cp_size - c.src_size);  // zero-fill the rest
  if (c.cp_size == 16) note_async_done(c.dst);
}

inline void cp_async_commit_group() {
  AsyncCopies& q = async_copies();
  q.committed.push_back(std::move(q.current));
  q.current.clear();
}

inline void cp_async_wait_group(long long n) {
  if (n < 0) trap_with("cp.async.wait_group %lld: negative count", n);
  AsyncCopies& q = async_copies();
  while (static_cast<long long>(q.committed.size()) > n) {
    for (const PendingCopy& c : q.committed.front()) perform(c);
    q.committed.pop_front();
  }
}

inline void cp_async_wait_all() {
  cp_async_commit_group();
  cp_async_wait_group(0);
}

// cp.async.mbarrier.arrive{.noinc}.shared{::cta}.b64 [addr] (PTX ISA, "cp.async.mbarrier.arrive"):
// an arrive-on of the barrier, triggered once every cp.async the thread issued before it has
// completed (committed or not; they leave the thread's groups, which keep their number, so a
// later wait_group counts as before). Without .noinc the pending count is first raised by one,
// in the current phase, so the arrive-on changes nothing on balance; with .noinc the arrive-on
// must have been counted in mbarrier.init's count. The emulator performs the copies here and
// then the arrive-on (the copies land no later than the phase they complete); each chunk they
// write records the phase (kg_mbarrier.h: check_tma_read, check_cp_async_fenced), so a read
// before the phase completed is still caught. The arrive-on releases the copies only, not the
// thread's other writes (it is the system's, not the thread's).
inline void cp_async_mbarrier_arrive(uint32_t addr, bool noinc) {
  const char* what = noinc ? "cp.async.mbarrier.arrive.noinc" : "cp.async.mbarrier.arrive";
  const uint32_t slot = mbarrier_slot(addr, what);
  AsyncCopies& q = async_copies();
  std::vector<PendingCopy> copies;  // in issue order
  for (std::vector<PendingCopy>& g : q.committed) {
    copies.insert(copies.end(), g.begin(), g.end());
    g.clear();
  }
  copies.insert(copies.end(), q.current.begin(), q.current.end());
  q.current.clear();
  Cta& C = *tctx().cta;
  MbarrierLock lock;
  MbarrierState& b = mbarrier_initialized(addr, what);
  if (!noinc) {
    if (b.pending + 1 > kMbarrierMaxCount) {
      trap_with("%s: the pending count of the mbarrier at shared 0x%x would exceed 2^20-1", what,
                addr);
    }
    b.pending += 1;
  }
  const uint64_t stamp = (static_cast<uint64_t>(slot) + 1) << 32 | b.phase.load() | kCpAsyncStamp;
  for (const PendingCopy& c : copies) {
    if (c.src_size > 0) std::memcpy(c.dst, c.src, c.src_size);
    std::memset(c.dst + c.src_size, 0, c.cp_size - c.src_size);  // zero-fill the rest
    ChunkShadow& sh = C.shadow[chunk_of(c.dst)];
    uint64_t w = sh.writes.load();  // the in-flight mark of this thread's copy: ordered by b now
    if (WriteStamp::of(w).in_flight() && WriteStamp::of(w).thread == tctx().linear) {
      sh.writes.compare_exchange_strong(w, 0);
    }
    const uint64_t old = sh.tma.exchange(stamp);
    const uint32_t old_slot = static_cast<uint32_t>(old >> 32) - 1u;
    const uint32_t old_phase = static_cast<uint32_t>(old) & ~kCpAsyncStamp;
    if (old != 0 && (old & ~uint64_t{kCpAsyncStamp}) != (stamp & ~uint64_t{kCpAsyncStamp}) &&
        C.mbarriers[old_slot].phase.load() <= old_phase) {
      report_hazard("%s: a copy writes shared 0x%x while an earlier TMA or cp.async write there "
                    "(mbarrier at shared 0x%x, phase %u) has not completed",
                    what, chunk_address(chunk_of(c.dst)), mbarrier_address(old_slot), old_phase);
    }
  }
  b.pending -= 1;  // (>= 1 before: a phase that completes starts over at the init count)
  mbarrier_maybe_complete(b);
}

// ---- conversions (cvt) to and from fp8, and f32 pairs to f16x2 / bf16x2 --------------------
// A "=h" (16-bit) or "=r" destination (the value zero-extended).
template <class D>
inline void set_bits(D& d, uint32_t v) {
  static_assert((sizeof(D) == 2 || sizeof(D) == 4) && std::is_trivially_copyable_v<D>,
                "cvt destination: a 16- or 32-bit register");
  if constexpr (sizeof(D) == 2) {
    const uint16_t h = static_cast<uint16_t>(v);
    std::memcpy(&d, &h, 2);
  } else {
    std::memcpy(&d, &v, 4);
  }
}
// cvt.rn.satfinite{.relu}.{e4m3x2,e5m2x2}.f32 d, a, b: a to the upper byte of d, b to the lower.
template <bool E5M2, bool Relu, class D>
inline void cvt_fp8x2_f32(D& d, float a, float b) {
  set_bits(d, static_cast<uint32_t>(double_to_fp8_satfinite(a, E5M2, Relu)) << 8 |
                  double_to_fp8_satfinite(b, E5M2, Relu));
}
// cvt.rn.satfinite{.relu}.{e4m3x2,e5m2x2}.f16x2 d, a: the upper half of a to the upper byte.
template <bool E5M2, bool Relu, class D>
inline void cvt_fp8x2_f16x2(D& d, uint32_t a) {
  const double hi = half_bits_to_float(static_cast<uint16_t>(a >> 16));
  const double lo = half_bits_to_float(static_cast<uint16_t>(a));
  set_bits(d, static_cast<uint32_t>(double_to_fp8_satfinite(hi, E5M2, Relu)) << 8 |
                  double_to_fp8_satfinite(lo, E5M2, Relu));
}
// cvt.rn{.relu}.f16x2.{e4m3x2,e5m2x2} d, a: exact; the upper byte of a to the upper half of d.
template <bool E5M2, bool Relu, class D>
inline void cvt_f16x2_fp8x2(D& d, uint32_t a) {
  auto one = [](uint8_t b) {
    double v = fp8_bits_to_double(b, E5M2);
    if (Relu && v < 0) v = 0.0;
    return static_cast<uint32_t>(double_to_half_bits(v));
  };
  set_bits(d, one(static_cast<uint8_t>(a >> 8)) << 16 | one(static_cast<uint8_t>(a)));
}
// cvt.rn{.relu}{.satfinite}.{f16x2,bf16x2}.f32 d, a, b: a to the upper half of d.
inline float relu_sat(float x, bool relu, bool sat, float max_norm) {
  if (relu && x < 0) x = 0.f;
  if (sat && !std::isnan(x)) x = std::fmax(-max_norm, std::fmin(max_norm, x));
  return x;
}
template <bool Relu, bool Sat, class D>
inline void cvt_f16x2_f32(D& d, float a, float b) {
  set_bits(d, static_cast<uint32_t>(float_to_half_bits(relu_sat(a, Relu, Sat, 65504.f))) << 16 |
                  float_to_half_bits(relu_sat(b, Relu, Sat, 65504.f)));
}
template <bool Relu, bool Sat, class D>
inline void cvt_bf16x2_f32(D& d, float a, float b) {
  constexpr float kMax = 3.38953139e38f;  // the largest finite bf16
  set_bits(d, static_cast<uint32_t>(float_to_bf16_bits(relu_sat(a, Relu, Sat, kMax))) << 16 |
                  float_to_bf16_bits(relu_sat(b, Relu, Sat, kMax)));
}

// An empty asm statement (`asm volatile("" ::: "memory")`) is a compiler-level fence.
inline void compiler_barrier() { std::atomic_signal_fence(std::memory_order_seq_cst); }

// fence.proxy.async{.shared::cta,.shared::cluster} (and without a state space): the thread's
// stmatrix and st.shared writes so far reach the async proxy (the race check above); .global and
// fence.mbarrier_init: ordering only (the emulator has one memory proxy).
inline void fence_proxy_async() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void fence_proxy_async_shared() {
  fence_generic_writes();
  mbarrier_note_proxy_fence();
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

// elect.sync R|P, membermask: the lowest lane of the mask is elected (every lane of the warp
// runs it: the emulator has no divergence model).
template <class R>
inline void elect_sync(uint32_t membermask, R& elected, bool& is_elected) {
  if (membermask == 0) trap_with("elect.sync: empty membermask");
  const uint32_t leader = static_cast<uint32_t>(__builtin_ctz(membermask));
  set_b32(elected, leader);
  is_elected = tctx().lane == leader;
}

// nanosleep.u32 t: suspends the thread for up to t ns; here it yields the CPU (a spin loop with
// nanosleep lets the other threads run).
inline void nanosleep(uint32_t) { fiber_poll(); }

// setmaxnreg.{inc,dec}.sync.aligned.u32 N: register reallocation has no effect on the CPU.
template <long long N>
inline void setmaxnreg() {
  static_assert(N >= 24 && N <= 256 && N % 8 == 0,
                "setmaxnreg: the register count is a multiple of 8 in [24, 256]");
}

}  // namespace kg_emu::ptx

#include "kg_tma.h"
#include "kg_wgmma.h"

#endif  // KG_PTX_H
