/* xla_attn C ABI, version 3: the params structs of kernels/<op>/params.h filled by
 * the caller, run on the Host or on a CUDA stream. For torch eager, EXLA, tests.
 * Every function returns 0 on success, else non-zero with a message in `error`. */
#pragma once
#include "cache/params.h"
#include "flash/params.h"
#include "paged/params.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 2: paged_attention params gained max_query_len (its layout and
 * xla_attn_paged_attention_workspace_size's arguments changed).
 * 3: flash_bwd params gained dlse (softmax_lse's cotangent), appended. */
#define XLA_ATTN_ABI_VERSION 3

/* The library is built with hidden visibility; these are its whole interface. */
#define XLA_ATTN_EXPORT __attribute__((visibility("default")))

XLA_ATTN_EXPORT int xla_attn_abi_version(void);
XLA_ATTN_EXPORT const char* xla_attn_version(void);
/* JSON: {"abi": 3, "version": ..., "cuda_runtime": ..., "modules": [...], "variants": [...]} */
XLA_ATTN_EXPORT const char* xla_attn_build_info(void);

XLA_ATTN_EXPORT int xla_attn_flash_fwd(const xla_attn_flash_fwd_params* params, int platform, void* stream,
                       char* error, size_t error_len);
XLA_ATTN_EXPORT int xla_attn_flash_bwd(const xla_attn_flash_bwd_params* params, int platform, void* stream,
                       char* error, size_t error_len);
XLA_ATTN_EXPORT int xla_attn_paged_attention(const xla_attn_paged_attention_params* params, int platform,
                             void* stream, char* error, size_t error_len);
XLA_ATTN_EXPORT int xla_attn_reshape_and_cache_flash(const xla_attn_reshape_and_cache_flash_params* params, int platform, void* stream,
                         char* error, size_t error_len);

/* The variant the dispatcher would pick for `op` on compute capability `arch`
 * (major*10+minor): its kernel name in `out`, or the "no kernel" message. */
XLA_ATTN_EXPORT int xla_attn_select_variant(const char* op, int dtype0, int dtype1, int head_dim,
                            unsigned features, int arch, char* out, size_t out_len);
/* Device scratch bytes the CUDA path of `op` needs for these params (0: none); the
 * caller allocates it and sets params->workspace / workspace_bytes. The Host path
 * needs none. */
XLA_ATTN_EXPORT size_t xla_attn_workspace_size(const char* op, const void* params);
/* The same from shapes alone, for frontends that size the workspace when they trace
 * (the JAX frontend passes it as the custom call's `workspace` result). */
XLA_ATTN_EXPORT size_t xla_attn_flash_fwd_workspace_size(int64_t total_q, int32_t batch,
                                                         int32_t num_heads, int32_t head_dim,
                                                         int32_t max_seqlen_q, int32_t max_seqlen_k);
/* v2: also K's rows and heads, its xla_attn_dtype and whether it is a paged cache, which
 * fp8's V^T needs (the sm90 forward's V given transposed); v1 sizes no V^T (that forward
 * then transposes V itself). */
XLA_ATTN_EXPORT size_t xla_attn_flash_fwd_workspace_size_v2(
    int64_t total_q, int64_t total_k, int32_t batch, int32_t num_heads, int32_t num_heads_k,
    int32_t head_dim, int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t kv_dtype,
    int32_t paged);
/* dtype: the xla_attn_dtype of q (float32 takes no workspace). */
XLA_ATTN_EXPORT size_t xla_attn_flash_bwd_workspace_size(int64_t total_q, int32_t batch,
                                                         int32_t num_heads, int32_t head_dim,
                                                         int32_t dtype);
XLA_ATTN_EXPORT size_t xla_attn_paged_attention_workspace_size(int64_t total_q,
                                                               int32_t max_num_seqs,
                                                               int32_t num_heads, int32_t head_dim,
                                                               int32_t max_blocks_per_seq,
                                                               int32_t block_size,
                                                               int32_t max_query_len);
/* sizeof the params struct of `op` (flash_fwd, flash_bwd, paged_attention, reshape_and_cache_flash),
 * or 0: lets bindings that mirror the structs (ctypes) check their layout. */
XLA_ATTN_EXPORT size_t xla_attn_params_size(const char* op);
/* Compute capability of the current CUDA device, or -1 with a message. */
XLA_ATTN_EXPORT int xla_attn_device_arch(char* error, size_t error_len);

#ifdef __cplusplus
}
#endif
