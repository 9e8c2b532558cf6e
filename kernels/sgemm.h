// oneDNN's sgemm, exported by the libdnnl.so.3 that MindSpore ships and has already loaded (its CPU MatMul):
// C = alpha op(A) op(B) + beta C, row-major, op = transpose for 'T'. Called from our worker threads, it runs on
// the calling thread.
#pragma once
#include <cstdint>

extern "C" int dnnl_sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
