// kg_cluster.h -- thread-block clusters of the CPU emulator (PTX ISA "Cluster of Cooperative
// Thread Arrays"): the blocks of a cluster run at once (kg_emulator.h: launch), barrier.cluster,
// mapa and .shared::cluster accesses to another block's shared memory (distributed shared
// memory), the special registers, and CUDA's C++ cluster functions. Included by kg_ptx.h.
//
// A .shared::cluster address is the target block's .shared::cta address with its rank + 1 in
// bits 24..27 (kg_ptx.h: kClusterRankShift); a .shared::cta address is the executing block's own.
// barrier.cluster.arrive / .wait: every thread of the cluster that has not exited arrives, a wait
// returns once all have (the arrive of the current phase, then its wait, alternately; a thread
// that leaves the kernel stops being expected). Its wait orders the block like __syncthreads for
// the race checks. Misuse traps: a second arrive before the wait, a wait without an arrive, a
// rank outside the cluster, an access to a block whose threads have all exited.
#ifndef KG_CLUSTER_H
#define KG_CLUSTER_H

namespace kg_emu {

// The generation of barrier.cluster this thread arrived at and has not waited for (-1: none).
// The generation of this thread's barrier.cluster.arrive not yet waited for (-1: none).
struct ClusterArrival {
  int64_t value = -1;
};
inline int64_t& cluster_arrival() {
  return fiber_local<ClusterArrival, kLocalClusterArrival>().value;
}

inline void cluster_thread_begin() {
  cluster_arrival() = -1;
  cluster_passed() = 0;
}

inline void cluster_barrier_complete(ClusterBarrierState& b) {
  b.arrived = 0;
  b.generation.fetch_add(1);
}

inline void cluster_thread_exit() {
  BarrierLock lock;
  ClusterBarrierState& b = tctx().launch->cluster_bar;
  if (cluster_arrival() >= 0 && cluster_arrival() == b.generation.load()) b.arrived -= 1;
  cluster_arrival() = -1;
  b.participants -= 1;
  if (b.arrived > 0 && b.arrived == b.participants) cluster_barrier_complete(b);
}

namespace ptx {

// barrier.cluster.arrive{.release,.relaxed}{.aligned}
inline void barrier_cluster_arrive() {
  if (cluster_arrival() >= 0) {
    trap_with("barrier.cluster.arrive: a second arrive before the barrier.cluster.wait of the "
              "first");
  }
  BarrierLock lock;
  ClusterBarrierState& b = tctx().launch->cluster_bar;
  cluster_arrival() = b.generation.load();
  b.arrived += 1;
  if (b.arrived == b.participants) cluster_barrier_complete(b);
}

// barrier.cluster.wait{.acquire}{.aligned}
inline void barrier_cluster_wait() {
  if (cluster_arrival() < 0) {
    trap_with("barrier.cluster.wait without a barrier.cluster.arrive before it");
  }
  ClusterBarrierState& b = tctx().launch->cluster_bar;
  const uint32_t gen = static_cast<uint32_t>(cluster_arrival());
  wait_while(b.generation, gen);
  cluster_arrival() = -1;
  cluster_passed() = gen + 1;  // that barrier.cluster phase (and every earlier one) completed
  ++tctx().epoch;
}

inline uint32_t checked_rank(long long rank, const char* what) {
  if (rank < 0 || rank >= static_cast<long long>(tctx().launch->ncta)) {
    trap_with("%s: block rank %lld outside the cluster of %u blocks", what, rank,
              tctx().launch->ncta);
  }
  return static_cast<uint32_t>(rank);
}

// mapa.shared::cluster.{u32,u64} d, a, rank: the .shared::cluster address of .shared::cta
// address a in block `rank`.
inline uint32_t mapa_shared(uint64_t addr, long long rank) {
  const uint32_t r = checked_rank(rank, "mapa.shared::cluster");
  const uint32_t a = static_cast<uint32_t>(addr);
  return (r + 1) << kClusterRankShift | (a & ~kClusterRankMask);
}

// mapa.{u32,u64} d, a, rank (generic addresses): the pointer to the same byte of block `rank`.
inline uint64_t mapa_generic(uint64_t addr, long long rank) {
  const uint32_t r = checked_rank(rank, "mapa");
  const unsigned char* p = reinterpret_cast<const unsigned char*>(static_cast<uintptr_t>(addr));
  const Cta& me = *tctx().cta;
  if (!in_shared_window(me, p, 0)) {
    trap_with("mapa: %p is not a generic address of the block's shared memory",
              static_cast<const void*>(p));
  }
  return static_cast<uint64_t>(
      reinterpret_cast<uintptr_t>(tctx().launch->ctas[r].smem + (p - me.smem)));
}

// ld / st .shared::cluster (and .shared{::cta}) of 4- or 8-byte elements, one or a vector.
template <class T>
inline T ld_shared(uint32_t addr, bool cluster, const char* what) {
  Cta* target = tctx().cta;
  unsigned char* p = cluster ? cluster_shared_bytes(addr, sizeof(T), sizeof(T), what, &target)
                             : shared_bytes(addr, sizeof(T), sizeof(T), what);
  if (target == tctx().cta) {
    const size_t chunk = chunk_of(p);
    check_generic_write(tctx().cta->shadow[chunk], chunk);
    check_tma_read(chunk);  // bytes a TMA (or tracked cp.async) wrote: after the mbarrier wait
  }
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <class T>
inline void st_shared(uint32_t addr, T v, bool cluster, const char* what) {
  Cta* target = tctx().cta;
  unsigned char* p = cluster ? cluster_shared_bytes(addr, sizeof(T), sizeof(T), what, &target)
                             : shared_bytes(addr, sizeof(T), sizeof(T), what);
  if (target == tctx().cta) note_generic_write(p, what);
  std::memcpy(p, &v, sizeof(T));
}

// Special registers (mov.u32 d, %name).
inline uint32_t sreg_dim(const uint3& v, int d) { return d == 0 ? v.x : d == 1 ? v.y : v.z; }
inline uint32_t sreg_dim(const dim3& v, int d) { return d == 0 ? v.x : d == 1 ? v.y : v.z; }
inline uint32_t sreg_tid(int d) { return sreg_dim(threadIdx, d); }
inline uint32_t sreg_ntid(int d) { return sreg_dim(blockDim, d); }
inline uint32_t sreg_ctaid(int d) { return sreg_dim(blockIdx, d); }
inline uint32_t sreg_nctaid(int d) { return sreg_dim(gridDim, d); }
inline uint32_t sreg_laneid(int) { return tctx().lane; }
inline uint32_t sreg_warpid(int) { return tctx().linear / 32; }
inline uint32_t sreg_nwarpid(int) { return tctx().launch->nwarps; }
inline uint32_t sreg_cluster_ctaid(int d) {
  return sreg_dim(blockIdx, d) % sreg_dim(tctx().launch->cluster, d);
}
inline uint32_t sreg_cluster_nctaid(int d) { return sreg_dim(tctx().launch->cluster, d); }
inline uint32_t sreg_clusterid(int d) {
  return sreg_dim(blockIdx, d) / sreg_dim(tctx().launch->cluster, d);
}
inline uint32_t sreg_nclusterid(int d) {
  return sreg_dim(gridDim, d) / sreg_dim(tctx().launch->cluster, d);
}
inline uint32_t sreg_cluster_ctarank(int) { return tctx().cta->rank; }
inline uint32_t sreg_cluster_nctarank(int) { return tctx().launch->ncta; }
inline uint32_t sreg_dynamic_smem_size(int) {
  return static_cast<uint32_t>(tctx().cta->smem_bytes);
}

}  // namespace ptx
}  // namespace kg_emu

// ---- CUDA's C++ cluster functions (sm_90) --------------------------------------------------------
inline dim3 __clusterDim() { return kg_emu::tctx().launch->cluster; }
inline dim3 __clusterRelativeBlockIdx() {
  using namespace kg_emu::ptx;
  return dim3(sreg_cluster_ctaid(0), sreg_cluster_ctaid(1), sreg_cluster_ctaid(2));
}
inline unsigned int __clusterRelativeBlockRank() { return kg_emu::tctx().cta->rank; }
inline unsigned int __clusterSizeInBlocks() { return kg_emu::tctx().launch->ncta; }
inline dim3 __clusterIdx() {
  using namespace kg_emu::ptx;
  return dim3(sreg_clusterid(0), sreg_clusterid(1), sreg_clusterid(2));
}
inline dim3 __clusterGridDimInClusters() {
  using namespace kg_emu::ptx;
  return dim3(sreg_nclusterid(0), sreg_nclusterid(1), sreg_nclusterid(2));
}
inline void __cluster_barrier_arrive() { kg_emu::ptx::barrier_cluster_arrive(); }
inline void __cluster_barrier_arrive_relaxed() { kg_emu::ptx::barrier_cluster_arrive(); }
inline void __cluster_barrier_wait() { kg_emu::ptx::barrier_cluster_wait(); }
inline void* __cluster_map_shared_rank(void* p, unsigned int rank) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(
      kg_emu::ptx::mapa_generic(reinterpret_cast<uintptr_t>(p), rank)));
}
inline const void* __cluster_map_shared_rank(const void* p, unsigned int rank) {
  return __cluster_map_shared_rank(const_cast<void*>(p), rank);
}
inline unsigned int __cluster_query_shared_rank(const void* p) {
  const kg_emu::Launch& L = *kg_emu::tctx().launch;
  const unsigned char* c = static_cast<const unsigned char*>(p);
  for (uint32_t r = 0; r < L.ncta; ++r) {
    if (kg_emu::in_shared_window(L.ctas[r], c, 0)) return r;
  }
  kg_emu::trap_with("__cluster_query_shared_rank(%p): not the shared memory of a block of the "
                    "cluster", p);
}
inline unsigned int __isClusterShared(const void* p) {
  const kg_emu::Launch& L = *kg_emu::tctx().launch;
  const unsigned char* c = static_cast<const unsigned char*>(p);
  for (uint32_t r = 0; r < L.ncta; ++r) {
    if (kg_emu::in_shared_window(L.ctas[r], c, 0)) return 1;
  }
  return 0;
}
inline unsigned int __isShared(const void* p) {
  return kg_emu::in_shared_window(*kg_emu::tctx().cta, static_cast<const unsigned char*>(p), 0);
}

#endif  // KG_CLUSTER_H
