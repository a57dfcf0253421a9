// Flash attention backward, sm90 family, head dims 129-256 (sm_90a; f16 and bf16): the
// dk/dv kernel of the atomic-dQ path on wgmma, as flash/bwd_sm90.cuh is for 33-128,
// between the same sm80 delta and dq-convert kernels.
//
// At d256 one thread cannot hold both dK and dV of its keys (D / 2 f32 each: 256
// registers), so the two consumer warpgroups share the block's 64 keys and split the
// work by gradient (as the sm80 family's paired blocks do): per tile (query head x 64
// query rows)
// - warpgroup 1 (the dV side): S^T = K Q^T, P^T = exp2(S^T - lse) with the masks,
//   softcap and ALiBi; P^T times softcap' to warpgroup 2 through shared memory (f32, in
//   the accumulator's own order); dV += P^T dO (P^T from registers);
// - warpgroup 2 (the dK side): dP^T = V dO^T, then dS^T = (P^T softcap') (dP^T - D),
//   16-bit to shared memory; dK += dS^T Q (dS^T from registers);
// - both: dQ = dS K over the block's 64 keys, 128 columns each (columns 0-127 on the dV
//   side), added into the f32 accumulator by bulk reductions, staged in the tile's Q
//   (dK side) or dO (dV side) once this warpgroup's products are done with it (no
//   shared memory is left for staging of its own: 64 KB at d256).
// Each warpgroup issues 2.5 of the tile's 5 products (64 x 64 x 256 each); the dK side
// waits for P^T once a tile, the dV side for dS^T once a tile.
#pragma once
#include "flash/bwd_sm90.cuh"

namespace xla_attn {

template <typename T>
__device__ void flash_bwd_dkdv_sm90_d256(const flash_sm90::BwdArgs& a) {
  using namespace flash_sm90;
  const xla_attn_flash_bwd_params& p = a.p;
  if (dkdv_padding_block<T>(p)) return;
  constexpr int D = 256, kKeys = kBwdKeysD256, kColBlocks = D / 64;
  constexpr int kNT = kBwdRows / 8;      // n8 tiles of S^T / dP^T (query rows)
  constexpr int kDT = D / 8;             // n8 tiles of dK, dV
  constexpr int kSteps = kBwdRows / 16;  // k-steps of dV += P^T dO, dK += dS^T Q
  constexpr uint32_t kKVBlock = kKeys * kRowBytes;       // a column block of K or V
  constexpr uint32_t kRowsBlock = kBwdRows * kRowBytes;  // a column block of Q or dO
  constexpr uint32_t kKV = kColBlocks * kKVBlock, kRows = kColBlocks * kRowsBlock;
  constexpr uint32_t kStatBytes = 2 * kBwdRows * 4;  // a tile's lse and D floats
  // dQ's 32-column accumulator chunks a consumer warp adds a tile (its warpgroup's 128
  // columns), staged in an 8 KB slice of a Q or dO tile
  constexpr int kDqChunks = D / 2 / sm80::kAccChunkCols;
  constexpr uint32_t kDqSliceBytes = uint32_t(kDqChunks * sm80::kAccChunk * 4);
  static_assert(4 * kDqSliceBytes == kRows, "four warps' dQ slices fill a Q or dO tile");
  extern __shared__ __align__(128) unsigned char smem[];

  BwdBlock blk;
  if (!bwd_block<kKeys, kBwdRows>(p, &blk)) return;
  const Sequence& s = blk.s;
  const int b = blk.b, hd = p.head_dim, n0 = blk.n0, i_lo = blk.i_lo, i_hi = blk.i_hi;

  const uint32_t base = (sm80::smem_addr(smem) + kAlign - 1) & ~uint32_t(kAlign - 1);
  const uint32_t sK = base, sV = sK + kKV, sQ = sV + kKV, sdO = sQ + kStages * kRows;
  const uint32_t sP = sdO + kStages * kRows;  // P^T softcap', f32 in fragment order
  const uint32_t sDs = sP + kBwdPD256Bytes;   // dS^T, keys x rows, 16-bit
  const uint32_t sStat = sDs + kBwdDsD256Bytes;  // + (tile % 2) * kStatBytes
  const BwdBars bar{sStat + 2 * kStatBytes};
  if (threadIdx.x == 0) bar.init();
  __syncthreads();

  if (threadIdx.x < 128) {
    sm90::regs_release<kProducerRegs>();
    bwd_produce<kColBlocks, kKeys, kBwdRows>(a, blk, bar, sK, sV, sQ, sdO, threadIdx.x);
    return;
  }
  sm90::regs_acquire<kConsumerRegs>();
  const int ct = threadIdx.x - 128;  // consumer thread 0 .. 255
  const int wg = sm90::warp_uniform(ct / 128), wt = ct % 128, warp = wt / 32, lane = ct % 32,
            g = lane / 4, t = lane % 4;
  const bool dv_side = wg == 0;
  const int key_w = 16 * warp;  // the warp's keys, block-relative (both warpgroups)
  float grad[1][kDT][4] = {};   // dV (dv_side) or dK
  float(&grad_flat)[kDT * 4] = reinterpret_cast<float(&)[kDT * 4]>(grad);
  // A tile's lse (the dV side's threads 0-63, stored as -lse log2 e) and D (the dK
  // side's threads 0-63), zeros past i_hi, loaded a tile ahead into sStat (two buffers)
  // and published by the tile's dS^T barrier.
  auto load_stat = [&](const BwdTileCursor& c) {
    const int i = i_lo + c.row * kBwdRows + wt;
    const float* src = dv_side ? p.softmax_lse : bwd_delta(p);
    return i < i_hi ? src[int64_t(blk.hk * blk.group + c.head) * p.total_q + s.q_start + i]
                    : 0.f;
  };
  auto store_stat = [&](int it, float x) {
    if (wt < kBwdRows) {
      store_stat_scaled(sStat + uint32_t(it % 2) * kStatBytes + 4u * uint32_t(wg * kBwdRows + wt),
                        x, dv_side ? -kLog2e : 1.f);
    }
  };
  if (blk.tiles > 0) {
    store_stat(0, wt < kBwdRows ? load_stat(blk.first) : 0.f);
    sm90::mbar_wait(bar.kv_full(), 0u);
    if (blk.keys_valid < kKeys) {
      zero_tiles_rows<kColBlocks>(sK, sV, kKeys, max(blk.keys_valid, 0), ct);
    }
    sm90::named_barrier(1, 256);
  }
  int h_prev = -1;
  sm80::BwdScore sc_mod{};
  BwdTileCursor tile = blk.first;
  const int tiles = sm90::warp_uniform(blk.tiles);
  for (int it = 0; it < tiles; ++it, tile.advance(blk.per_head, blk.group)) {
    const int st = it % kStages, h = blk.hk * blk.group + tile.head,
              i0 = i_lo + tile.row * kBwdRows;
    const uint32_t tQ = sm90::warp_uniform(sQ + st * kRows), tdO = tQ + kStages * kRows;
    if (h != h_prev) {
      h_prev = h;
      sc_mod = bwd_score_of(p, b, h);
    }
    sm90::mbar_wait(bar.full(st), uint32_t(it / kStages) & 1u);
    if (i0 + kBwdRows > i_hi) {  // rows past the block's last: zeros (block-uniform)
      zero_tiles_rows<kColBlocks>(tQ, tdO, kBwdRows, i_hi - i0, ct);
      sm90::named_barrier(1, 256);
    }

    // S^T = K Q^T (dV side) or dP^T = V dO^T (dK side): the block's 64 keys x the
    // tile's rows. Descriptors as a base plus constant steps (bwd_sm90.cuh says why).
    float sp[1][kNT][4];
    float(&sp_flat)[kNT * 4] = reinterpret_cast<float(&)[kNT * 4]>(sp);
    uint64_t kv_desc = sm90::smem_desc(dv_side ? sK : sV, 16);
    uint64_t rows_desc = sm90::smem_desc(dv_side ? tQ : tdO, 16);
    asm volatile("" : "+l"(kv_desc));
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t at = uint32_t(kk / 4) * kKVBlock + uint32_t(kk % 4) * 32u;
      const uint32_t rows_at = uint32_t(kk / 4) * kRowsBlock + uint32_t(kk % 4) * 32u;
      sm90::wgmma_ss<kBwdRows, T, sm90::SsMajor::kK, kDescLowWord>(
          sp_flat, sm90::desc_plus(kv_desc, at), sm90::desc_plus(rows_desc, rows_at), kk > 0);
    }
    sm90::wgmma_commit();
    // The previous tile's stage back to the producer, once its dQ reduction has read
    // the warp's slice of it (below), behind this tile's first product.
    if (it > 0) {
      if (lane == 0) sm90::bulk_wait<0, /*kRead=*/true>();
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(bar.empty((it - 1) % kStages));
    }
    BwdTileCursor next = tile;  // the next tile's lse / D row, while the product runs
    next.advance(blk.per_head, blk.group);
    const float next_stat = it + 1 < blk.tiles && wt < kBwdRows ? load_stat(next) : 0.f;
    sm90::wgmma_wait<0>();
    sm90::wgmma_hold(sp_flat);

    // Element (nt, 2 hf + e): key n0 + key_w + g + 8 hf, row i0 + 8 nt + 2t + e. The
    // exchange slot of fragment nt: 16 bytes a thread, 2 KB a fragment.
    const uint32_t stat = sStat + uint32_t(it % 2) * kStatBytes;
    const uint32_t p_lane = sP + 16u * uint32_t(wt);
    uint32_t frag[kSteps][4];  // P^T (dV side) or dS^T, as wgmma A fragments
    // grad += frag x the stage's tile `rows` (dO or Q): k-steps of 16 rows (2 KB of the
    // tile), N = 256 across the column blocks (the leading offset).
    auto add_grad = [&](uint32_t rows) {
      sm90::wgmma_hold(grad_flat);
      sm90::wgmma_hold(frag);
      sm90::wgmma_fence();
      const uint64_t rows_desc = sm90::smem_desc(rows, kRowsBlock);
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk) {
        sm90::wgmma_rs<D, T, kDescLowWord>(
            grad_flat, frag[kk], sm90::desc_plus(rows_desc, uint32_t(kk) * 16u * kRowBytes));
      }
      sm90::wgmma_commit();
    };
    if (dv_side) {
      const bool mask = (i0 < blk.full_lo) | (i0 + kBwdRows > blk.full_hi);
      // P^T and P^T softcap': the common tile (no mask, softcap or ALiBi) an FFMA and
      // the exp2 an element, every other the general copy (one choice a tile: see
      // bwd_sm90.cuh's grads for why).
      auto probs = [&](const bool kGeneral) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const int col = nt * 8 + 2 * t;
          const float2 nlse = stat_pair<true>(stat + 4u * uint32_t(col));
          const float nlse2[2] = {nlse.x, nlse.y};
          float pg[4];
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = sp[0][nt][2 * hf + e];
              if (!kGeneral) {
                x = fast_exp2(fmaf(x, sc_mod.mul, nlse2[e]));
                pg[2 * hf + e] = x;
              } else {
                const int key = n0 + key_w + g + 8 * hf, i = i0 + col + e;
                const int64_t pos = int64_t(i) + s.offset;
                float dgrad;
                float pr = sc_mod.prob(x, pos, key, -nlse2[e], &dgrad);
                if (mask && !(key < s.num_k && i < i_hi && blk.win.visible(pos, key))) pr = 0.f;
                x = pr;
                pg[2 * hf + e] = pr * dgrad;
              }
            }
          }
          asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(p_lane + 2048u * nt),
                       "f"(pg[0]), "f"(pg[1]), "f"(pg[2]), "f"(pg[3])
                       : "memory");
          if (nt % 2 == 1) sm80::accum_to_a<T>(frag[nt / 2], sp[0][nt - 1], sp[0][nt]);
        }
      };
      if (!mask && !sc_mod.capped && sc_mod.slope == 0.f) {
        probs(false);
      } else {
        probs(true);
      }
      sm90::named_arrive(2, 256);  // P^T softcap' is in sP
      add_grad(tdO);               // dV += P^T dO
    } else {
      sm90::named_barrier(2, 256);  // the dV side's P^T softcap'
      // dS^T to sDs (keys x rows, 16-bit) for dQ = dS K (store_ds_step).
      const uint32_t ds_lane = ds_lane_of<false>(sDs, key_w, lane);
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk) {
#pragma unroll
        for (int nt = 2 * kk; nt < 2 * kk + 2; ++nt) {
          const float2 del = stat_pair<true>(stat + 4u * uint32_t(kBwdRows + nt * 8 + 2 * t));
          float4 pg;
          asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                       : "=f"(pg.x), "=f"(pg.y), "=f"(pg.z), "=f"(pg.w)
                       : "r"(p_lane + 2048u * nt));
          float(&d)[4] = sp[0][nt];
          d[0] = pg.x * (d[0] - del.x);
          d[1] = pg.y * (d[1] - del.y);
          d[2] = pg.z * (d[2] - del.x);
          d[3] = pg.w * (d[3] - del.y);
        }
        sm80::accum_to_a<T>(frag[kk], sp[0][2 * kk], sp[0][2 * kk + 1]);
        store_ds_step<false>(ds_lane, 0u, kk, frag[kk]);
      }
      sm90::fence_proxy_async_shared();
    }
    if (it + 1 < blk.tiles) store_stat(it + 1, next_stat);
    sm90::named_barrier(3, 256);  // dS^T (and the next tile's lse / D)
    if (!dv_side) add_grad(tQ);  // dK += dS^T Q

    // dQ = dS K over the block's 64 keys: column blocks 2 wg and 2 wg + 1 (64 f32 a
    // thread: the tile's 64 rows x 128 columns).
    float dq[2][32];
    uint64_t kcol_desc = sm90::smem_desc(sK + uint32_t(2 * wg) * kKVBlock, 0);
    asm volatile("" : "+l"(kcol_desc));
    const uint64_t ds_desc = sm90::smem_desc(sDs, 0);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint32_t keys_at = uint32_t(16 * kk) * kRowBytes;
#pragma unroll
      for (int cb = 0; cb < 2; ++cb) {
        sm90::wgmma_ss<64, T, sm90::SsMajor::kMN, kDescLowWord>(
            dq[cb], sm90::desc_plus(ds_desc, keys_at),
            sm90::desc_plus(kcol_desc, cb * kKVBlock + keys_at), kk > 0);
      }
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::wgmma_hold(dq[0]);
    sm90::wgmma_hold(dq[1]);
    // Rows 16 warp + g (+ 8) of the tile into the accumulator's chunks 4 wg + 2 cb + u
    // (32 columns each; chunks past hd do not exist). A row chunk wholly past the
    // block's rows adds nothing (it may be the next sequence's). The warp's four chunks
    // go through an 8 KB slice of the stage's tile that only its own warpgroup can
    // still be reading (the dV side: dO, which its dV product read; the dK side: Q, its
    // dK product's; the other side's reads of each ended before the dS^T barrier), in
    // the accumulator's layout, and one bulk reduction adds them (dq_rows_bulk_add); the
    // stage goes back to the producer in the next tile, behind its first product, once
    // that has read the slice. H200, kernel time at the base clock, fwd+bwd
    // against the reds: S = 1024 full / causal +8.0 / +3.6 %, 4096 full +11.0 %, 8192
    // causal +10.8 %; with the read waited for here, at the tile's end, -10..-13 %
    // (docs/benchmarks.md 2026-11-29 (51)).
    if (i_hi - i0 > 16 * warp) {
      // (at least one: head dims 129-256 take 5-8 chunks)
      const int chunks = min(kDqChunks, sm80::bwd_acc_col_chunks(hd) - kDqChunks * wg);
      dq_rows_bulk_add<kDqChunks, /*kTestChunks=*/true>(
          reinterpret_cast<const float(&)[16 * kDqChunks]>(dq),
          (dv_side ? tdO : tQ) + uint32_t(warp) * kDqSliceBytes, lane, chunks, [&] {
            return bwd_dq_accum_rows(p, h, s, b, i0 / sm80::kAccChunkRows + warp) +
                   kDqChunks * wg * sm80::kAccChunk;
          });
    }
  }
  // the last reduction has read its slice before the block may end
  if (lane == 0) sm90::bulk_wait<0, /*kRead=*/true>();

  // dV (dV side) or dK (times the softmax scale) of the warp's 16 keys, staged in the
  // warp's own rows of sV / sK. The dV side's last dQ = dS K reads sK: both meet first.
  sm90::named_barrier(1, 256);
  bwd_store_grad<T, kDT>(p, blk, dv_side ? sV : sK, kKVBlock, key_w, lane, grad,
                         dv_side ? 1.f : p.softmax_scale, dv_side ? p.dv : p.dk);
}

}  // namespace xla_attn
