// The tensor-core expand for prefill (from kTallExpandRows rows of out, pool rank kFlatMaxR < R <= kRegsMaxR;
// ops/sgmv_plan.h) where v is fp32 or the build has no sm_90a code (else kernels/sgmv_expand_wgmma.cuh, 7% faster a
// layer at r64): independent warps that keep a B block's fragments in registers.
//   out[row, n] += scaling[slot] * sum_{j<rank} v[row, i*R + j] * lora_b[slot, n, j]     n in slice i
// A warp item is one work-list tile (16 rows) x kRegsCols = 64 columns of one slice. Items are numbered column tile
// first, and each warp takes a contiguous run of them, so consecutive items share a column tile and, within a
// segment, a slot: the B fragments (loaded from global memory straight into registers) serve the whole run. A warp
// keeps ST - 1 items' out rows and v rows in flight (cp.async into its own shared-memory stages) while it computes
// one; no block barrier. The warp's 64 columns are laid out (regs_col) so that lane quad t's accumulators are two
// 16-byte chunks of out, columns 32 j + 8 t .. + 7: the epilogue reads a lane's out row as two chunks and stores
// them as such, four lanes a 64-byte run of whole sectors. v is one plane: at prefill the shrink sums its splits
// itself and writes v in T (the same sums and rounding as every expand's, half the bytes of fp32). A warp reads the
// tiles of 32 items at once, a lane each, and takes an item's slot, rank and rows by shuffles (RegsMeta): ncu had the
// per-item chain of dependent metadata loads as the top stall (long_scoreboard); layer µs at prefill 8x1024, H100,
// the same call: r16 784 -> 774, r64 1040 -> 1010 (again 783 -> 773, 1050 -> 1020).
// Why: the tall kernel runs 64 x 128 tiles through shared memory behind block barriers, loads B per item and sums
// v's planes per column tile; ncu found it at 30-45% of DRAM bandwidth at prefill (gate_up r16 472 µs, r64 832).
// Again at 01d6aed (thirtieth session), r64 prefill: tall 1480 against 894 µs; ncu: qkv's expand 179 against 114.
// Layer µs at prefill 8x1024 on an H100 (bench_kernels, the same call): tall 1120 / 1750 (r16 / r64) -> this 948 /
// 1240, when lane quad t held columns 16 t .. + 15 (each store then wrote half of every sector it touched; ncu: L2 at
// 80-86% of its peak); a first form that kept one item's out rows and v in registers (no stages) 1120 / 2190. With
// whole sectors per store and the tall shrink (ops/sgmv_plan.h) the layer is 838 / 1090 (gate_up's expand at r16 by
// ncu 402 -> 388 µs, L2 86% -> 69%). Reading the next item's metadata one iteration ahead was 2-5% slower; 6 stages
// (KS <= 2; 4 for KS = 4) r16 774 -> 790, r64 1010 -> 1020; streaming stores (st.global.cs) and runs of warps aligned
// to column tiles (so that warps of neighbouring column tiles read the same rows at once) no change; items ordered two
// column tiles at a time (a warp's consecutive items cover 256 contiguous bytes of each row, two sets of B fragments,
// 117 registers) r16 765 -> 793, r64 974 -> 973; 5 stages at 4 CTAs (v rows unpadded, to fit) 764 -> 765. Fewer
// instructions an item (ncu's source view of the r64 o expand: ~900 an item, 28% of the stall samples in the copies'
// address code, 37% in compute; the twenty-fourth session): copies without branches or pointer selects, no division
// per item, v in T used without the 0 + v round trip: bit-equal, r16 763 -> 755 but r64 891 -> 906 (three alternating
// runs each; KS = 4 then spilled 8 bytes in the loop; at 3 stages x 3 CTAs, 162 registers, no spill: 903 against
// 907 for that form, 891 for this one), rejected. A warp sweep (warps of one column tile taking every
// lanes-th tile, so that all warps cross the rows together): r16 771 -> 831, r64 976 -> 1280 (B reloaded per item). At
// decode
// (2 to 1023 rows) it lost to the stream and 16-row kernels in every case measured (a B block per item: r64 64x1
// uniform sorted 271 against 137, r16 256x1 sorted 106 against 85).
//
// Bits: a row's sum is the same mma.sync m16n8k16 chain over the same k16 steps (those under the rank) of the same
// operands (v summed over its planes in plane order from 0, rounded to T, 0 past the rank; B 0 past the rank) with
// the same fma epilogue as the 16-row, stream and tall kernels. Which n8 slot of an MMA holds a column does not enter
// the column's sum. A v of T is used as it is, without the `0 + v` round trip of the 16-row, stream and tall kernels
// (as the flat expand does: it only turns -0 into +0, and the chain starts at +0, so a -0 operand cannot change a
// sum); fewer instructions an item: r64 prefill 8x1024 895-896 -> 884-885 µs a layer (H100, two orders, Triton 887;
// thirtieth session). So the choice among the kernels (by rows and R, ops/sgmv_plan.h) keeps batch invariance.
// Raw pointers only; no torch headers.
#pragma once
#include <cstdint>
#include <type_traits>
#include <cuda_runtime.h>

#include "kernels/launch.cuh"
#include "kernels/mma_tile.cuh"

namespace lora_kernels {

constexpr int kRegsWarps = 4, kRegsThreads = 32 * kRegsWarps, kRegsMaxR = 64;
constexpr int kRegsNT = 8, kRegsCols = 8 * kRegsNT;  // n8 tiles and columns of a warp item

// Column (0..63) of n8 tile nt, accumulator column c (0..7): lane quad t = c / 2 holds the 16-byte chunks 4 j + t
// (columns 32 j + 8 t .. + 7, j = 0, 1), tile nt = 4 j + e / 2 element e of chunk j.
__device__ __forceinline__ int regs_col(int nt, int c) {
  return 32 * (nt >> 2) + 8 * (c >> 1) + 2 * (nt & 3) + (c & 1);
}
// Where 16-byte chunk c of staged out row r lies: rows r and r + 1, read by one quarter warp, in opposite halves.
__device__ __forceinline__ int regs_chunk(int r, int c) { return r * 8 + (c ^ ((r & 1) << 2)); }

// One warp item: the tile's slot (-1: nothing to do), rank, the item's columns [n0, n_end) and v column of its
// slice.
struct RegsItem {
  int slot, rank, ct, n0, n_end, vcol0;
};

// The tiles of 32 consecutive items of a warp's run, one a lane (lane i: item base + i), so that an item's metadata
// costs a few shuffles instead of a chain of dependent loads per item (work list, rank).
struct RegsMeta {
  int base;
  TileInfo ti;
};

// Item `item` (column tile item / tiles, tile item % tiles) and, in lanes 0..15, the physical row of tile row `lane`
// (-1 where none). Items are asked for in increasing order; m is refilled every 32.
__device__ __forceinline__ RegsItem regs_item(const ExpandArgs& p, int item, int tiles, int lane, int& row,
                                              RegsMeta& m) {
  if (item < m.base || item - m.base >= 32) {  // warp-uniform
    m.base = item;
    m.ti = load_tile(p.w, (item + lane) % tiles, p.R);
  }
  const int src = item - m.base;
  TileInfo ti;
  ti.slot = __shfl_sync(0xffffffffu, m.ti.slot, src);
  ti.rank = __shfl_sync(0xffffffffu, m.ti.rank, src);
  ti.row0 = __shfl_sync(0xffffffffu, m.ti.row0, src);
  ti.rows = __shfl_sync(0xffffffffu, m.ti.rows, src);
  const int ct = item / tiles, sl = slice_of(p, ct);
  row = ti.slot >= 0 && lane < kTileM ? tile_row(p.w, ti, lane) : -1;
  return RegsItem{ti.slot, ti.rank, ct, tile_col0(p, sl, ct, kRegsCols),
                  pick(p.offsets, sl + 1), sl * p.R};
}

// A stage of one warp's pipeline: the item, its rows, its out rows (regs_chunk: the reads of a quarter warp, two
// rows, hit distinct banks) and its v rows (KS k16 steps, padded by 16
// bytes: the 4-byte fragment reads of 8 rows hit distinct banks).
template <typename V, int KS>
struct alignas(16) RegsStage {
  static constexpr int v_chunks = KS * 16 * static_cast<int>(sizeof(V)) / 16, v_ld = (v_chunks + 1) * 16;
  uint4 out[kTileM * kRegsCols / 8];
  unsigned char v[kTileM * v_ld];
  RegsItem item;
  int rows[kTileM];
};

// KS = 4 (R > 32): 2 stages at 4 CTAs an SM (128 registers a thread) rather than 3 stages at 3 CTAs (170): layer µs
// at prefill 8x1024, r64, H100, the same call: 1010 -> 971 (3 stages at 4 CTAs, 24 bytes of spills: 972). For KS <= 2
// nothing gained from more CTAs: r16 3 stages at 6 CTAs (80 registers) 766 -> 767, 2 stages at 8 CTAs (64) 867, 3 at
// 5 (96) 776.
template <int KS>
constexpr int regs_stages() { return KS <= 2 ? 4 : 2; }
template <int KS>
constexpr int regs_min_ctas() { return 4; }  // register budget: 128 a thread
template <typename V, int KS>
constexpr int regs_smem_bytes() { return kRegsWarps * regs_stages<KS>() * static_cast<int>(sizeof(RegsStage<V, KS>)); }

// Two 16-bit elements (k, k + 1) of a B row as one fragment register, 0 at and past `rank`.
template <typename T>
__device__ __forceinline__ uint32_t regs_pair(const T* src, int k, int rank) {
  if (k >= rank) return 0u;
  uint32_t r = __ldg(reinterpret_cast<const unsigned*>(src));
  if (k + 1 >= rank) r &= 0xffffu;  // little-endian: element k is the low half
  return r;
}

// B fragments of the item's slot and columns for KS k16 steps: f[ks][nt][h] holds B[n][16 ks + 8 h + 2 t, +1] for
// the lane's fragment column n = n0 + regs_col(nt, g); 0 past the rank and the slice. No kernel writes the weights.
template <typename T, int KS>
__device__ __forceinline__ void regs_load_b(uint32_t (&f)[KS][kRegsNT][2], const T* b, const ExpandArgs& p,
                                            const RegsItem& it, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < kRegsNT; ++nt) {
    const int n = it.n0 + regs_col(nt, g);
    const T* src = b + (static_cast<int64_t>(it.slot) * p.out_total + (n < it.n_end ? n : it.n0)) * p.R;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k = 16 * ks + 8 * h + 2 * t;
        f[ks][nt][h] = n < it.n_end ? regs_pair(src + k, k, it.rank) : 0u;
      }
  }
}

// The stage <- item, rows (lanes 0..15 hold them), out rows and v rows by cp.async (v zero-filled past the rank).
// After griddep_wait: an earlier kernel writes v and out. Few instructions a copy (the issue path is what the
// kernel is bound by): the stage's shared addresses converted once, each lane's row indices shuffled once for the
// out and the v copies where they coincide (v of 8 chunks a row), and rows or columns that do not exist copied as
// 0 bytes (zero-filled, never read back: the epilogue skips them) instead of a branch around each copy.
template <typename T, typename V, int KS>
__device__ __forceinline__ void regs_issue(RegsStage<V, KS>& st, const V* v, const T* out, const ExpandArgs& p,
                                           const RegsItem& it, int row, int lane) {
  using S = RegsStage<V, KS>;
  if (lane == 0) st.item = it;
  if (lane < kTileM) st.rows[lane] = row;
  if (it.slot < 0) return;  // warp-uniform
  const uint32_t out_s = smem_addr(st.out), v_s = smem_addr(st.v);
  const int c = lane & 7, n = it.n0 + 8 * c;
  const bool col = n < it.n_end;
  constexpr int kRows = kTileM * 8 / 32;  // rows a lane copies: (lane >> 3) + 4 i
  int rr[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) rr[i] = __shfl_sync(0xffffffffu, row, (lane >> 3) + 4 * i);
#pragma unroll
  for (int i = 0; i < kRows; ++i) {  // out: 8 chunks a row
    const int r = (lane >> 3) + 4 * i;
    const bool ok = rr[i] >= 0 && col;
    cp_async16_s(out_s + 16 * regs_chunk(r, c), ok ? out + static_cast<int64_t>(rr[i]) * p.out_total + n : out,
                 ok ? 16 : 0);
  }
  constexpr int kElems = 16 / static_cast<int>(sizeof(V));
#pragma unroll
  for (int i = 0; i < (kTileM * S::v_chunks + 31) / 32; ++i) {  // v: v_chunks a row
    const int idx = lane + 32 * i, r = idx / S::v_chunks, vc = idx % S::v_chunks;
    int vr;
    if constexpr (S::v_chunks == 8) {
      vr = rr[i];  // the out copies' row
    } else {
      vr = __shfl_sync(0xffffffffu, row, r % kTileM);
    }
    if (idx < kTileM * S::v_chunks) {
      const int k = vc * kElems, bytes = vr >= 0 ? max(0, min(16, (it.rank - k) * static_cast<int>(sizeof(V)))) : 0;
      cp_async16_s(v_s + r * S::v_ld + vc * 16, bytes ? v + static_cast<int64_t>(vr) * p.N + it.vcol0 + k : v, bytes);
    }
  }
}

// The stage's item: A fragments of v from the stage (rounded to T), the MMAs over the k16 steps under the rank, then
// out = fma(scale, acc, out) from the staged rows and 16-byte stores.
template <typename T, typename V, int KS>
__device__ __forceinline__ void regs_compute(const RegsStage<V, KS>& st, const uint32_t (&bf)[KS][kRegsNT][2], T* out,
                                             const ExpandArgs& p, int lane) {
  using S = RegsStage<V, KS>;
  const RegsItem it = st.item;
  const int g = lane >> 2, t = lane & 3;
  WarpAcc<1, kRegsNT> acc;
  zero_acc(acc);
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    if (16 * ks >= it.rank) break;
    uint32_t a[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = g + 8 * (q & 1), k = 16 * ks + 8 * (q >> 1) + 2 * t;
      if constexpr (std::is_same_v<V, T>) {  // v of T as it is (Bits, above)
        a[q] = *reinterpret_cast<const uint32_t*>(st.v + r * S::v_ld + k * sizeof(V));
        continue;
      }
      const Pack<V, 2> pv = *reinterpret_cast<const Pack<V, 2>*>(st.v + r * S::v_ld + k * sizeof(V));
      Pack<T, 2> pk;
      pk.v[0] = from_float<T>(0.f + to_float(pv.v[0]));
      pk.v[1] = from_float<T>(0.f + to_float(pv.v[1]));
      a[q] = *reinterpret_cast<const uint32_t*>(&pk);
    }
#pragma unroll
    for (int nt = 0; nt < kRegsNT; ++nt) mma_16816<T>(acc[0][nt], a, bf[ks][nt][0], bf[ks][nt][1]);
  }
  const float scale = p.scalings[it.slot];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h, row = st.rows[r];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int cc = 4 * c + t, n = it.n0 + 8 * cc;
      if (row < 0 || n >= it.n_end) continue;
      Pack<T, 8> pk = *reinterpret_cast<const Pack<T, 8>*>(&st.out[regs_chunk(r, cc)]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {  // chunk element e: column 32 c + 8 t + e, n8 tile 4 c + e / 2
        const int nt = 4 * c + e / 2, j = e % 2;
        pk.v[e] = from_float<T>(expand_out(to_float(pk.v[e]), scale, acc[0][nt][2 * h + j]));
      }
      *reinterpret_cast<Pack<T, 8>*>(out + static_cast<int64_t>(row) * p.out_total + n) = pk;
    }
  }
}

// v: one plane (the folded shrink's v, the split reduction's sum, or v itself) of T or fp32; p.splits must be 1.
template <typename T, typename V, int KS>
__global__ void __launch_bounds__(kRegsThreads, regs_min_ctas<KS>())
    sgmv_expand_regs_kernel(const V* __restrict__ v, const T* __restrict__ b, T* __restrict__ out, ExpandArgs p) {
  constexpr int ST = regs_stages<KS>();
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  RegsStage<V, KS>* st = reinterpret_cast<RegsStage<V, KS>*>(smem_raw) + warp * ST;
  griddep_launch_dependents();
  const int warps = gridDim.x * kRegsWarps, tiles = num_tiles(p.w), total = tiles * p.n_tiles;
  const int wid = blockIdx.x * kRegsWarps + warp;
  const int per = (total + warps - 1) / warps;
  const int i0 = wid * per, i1 = min(i0 + per, total);
  uint32_t bf[KS][kRegsNT][2];
  int b_slot = -1, b_ct = -1;  // whose fragments bf holds
  int row;
  RegsMeta meta{-64, {}};
  const auto item_at = [&](int item) { return regs_item(p, item, tiles, lane, row, meta); };
  if (i0 < i1) {  // the first item's B before griddep_wait: no kernel writes the weights
    const RegsItem it = item_at(i0);
    if (it.slot >= 0) {
      regs_load_b<T, KS>(bf, b, p, it, lane);
      b_slot = it.slot;
      b_ct = it.ct;
    }
  }
  griddep_wait();  // v and out are written by earlier kernels; every CTA waits (see sgmv_expand_mma_kernel)
  for (int s = 0; s + 1 < ST; ++s) {
    if (i0 + s < i1) {
      const RegsItem it = item_at(i0 + s);
      regs_issue<T, V, KS>(st[s], v, out, p, it, row, lane);
    }
    cp_async_commit();
  }
  for (int k = 0; i0 + k < i1; ++k) {
    const int next = i0 + k + ST - 1;
    if (next < i1) {
      const RegsItem it = item_at(next);
      regs_issue<T, V, KS>(st[(k + ST - 1) % ST], v, out, p, it, row, lane);
    }
    cp_async_commit();
    cp_async_wait<ST - 1>();  // item k's group
    __syncwarp();
    const RegsStage<V, KS>& cur = st[k % ST];
    const int slot = cur.item.slot, ct = cur.item.ct;
    if (slot >= 0) {
      if (slot != b_slot || ct != b_ct) {  // warp-uniform
        regs_load_b<T, KS>(bf, b, p, cur.item, lane);
        b_slot = slot;
        b_ct = ct;
      }
      regs_compute<T, V, KS>(cur, bf, out, p, lane);
    }
    __syncwarp();  // the stage is refilled next
  }
}

template <typename T, typename V, int KS>
cudaError_t launch_expand_regs_ks(const V* v, const T* b, T* out, const ExpandArgs& p, LaunchCfg cfg) {
  constexpr int smem = regs_smem_bytes<V, KS>();
  // Each warp's run is fixed by the grid, so the grid is what the SMs hold at once (no CTA waits for another's end).
  const int per_sm = resident_ctas_per_sm<sgmv_expand_regs_kernel<T, V, KS>>(kRegsThreads, smem);
  int dev = 0, sms = 0;
  if (per_sm > 0 && cudaGetDevice(&dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && cfg.grid > per_sm * sms)
    cfg.grid = per_sm * sms;
  return launch_kernel<sgmv_expand_regs_kernel<T, V, KS>>(cfg, kRegsThreads, smem, v, b, out, p);
}

template <typename T, typename V>
cudaError_t launch_expand_regs(const V* v, const T* b, T* out, const ExpandArgs& p, const LaunchCfg& cfg) {
  if (p.R <= 16) return launch_expand_regs_ks<T, V, 1>(v, b, out, p, cfg);
  if (p.R <= 32) return launch_expand_regs_ks<T, V, 2>(v, b, out, p, cfg);
  return launch_expand_regs_ks<T, V, 4>(v, b, out, p, cfg);
}

}  // namespace lora_kernels
