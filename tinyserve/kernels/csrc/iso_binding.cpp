// Torch binding of the ISO CUDA launchers (compiled on the GPU machine by
// torch.utils.cpp_extension; the .cu files themselves need no torch headers).
// Shapes and dtypes are checked by kernels/iso_cuda.py; this file only forwards pointers.
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

extern "C" int tinyserve_iso_store(void*, void*, int64_t, const void*, const void*, int64_t,
                                   int64_t, const void*, int, int, int, int, int, int,
                                   cudaStream_t);
extern "C" int tinyserve_iso_dequant_rows(const void*, int64_t, const int64_t*, void*, int, int,
                                          int, int, int, cudaStream_t);
extern "C" int tinyserve_iso_decode(const float*, const void*, const void*, int64_t,
                                    const int32_t*, int64_t, const int32_t*, int, int, int, int,
                                    int, int, int, float, int, float*, float*, void*, int64_t,
                                    int, cudaStream_t);

static int dtype_code(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return 0;
    case torch::kBFloat16: return 1;
    case torch::kFloat16: return 2;
    default: TORCH_CHECK(false, "ISO kernels take float32, bfloat16 or float16, got ",
                         t.scalar_type());
  }
  return -1;
}

static void check_rc(int rc, const char* what) {
  TORCH_CHECK(rc == 0, what, " failed with code ", rc,
              rc == 2 ? " (bad format or head_dim)" : rc == 3 ? " (bad GQA group)" : "");
}

void store(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor loc, torch::Tensor k,
           torch::Tensor v, int64_t bits) {
  const int64_t n = k.size(0), heads = k.size(1), d = k.size(2);
  auto stream = c10::cuda::getCurrentCUDAStream(k.device().index()).stream();
  const int rc = tinyserve_iso_store(
      k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k.data_ptr(), v.data_ptr(),
      k.stride(0), v.stride(0), loc.data_ptr(), loc.scalar_type() == torch::kInt64 ? 1 : 0,
      (int)n, (int)heads, (int)d, (int)bits, dtype_code(k), stream);
  check_rc(rc, "iso store");
}

void dequant_rows(torch::Tensor cache, torch::Tensor slots, torch::Tensor out, int64_t bits) {
  auto stream = c10::cuda::getCurrentCUDAStream(cache.device().index()).stream();
  const int rc = tinyserve_iso_dequant_rows(
      cache.data_ptr(), cache.stride(0), slots.data_ptr<int64_t>(), out.data_ptr(),
      (int)out.size(0), (int)out.size(1), (int)out.size(2), (int)bits, dtype_code(out), stream);
  check_rc(rc, "iso dequant");
}

void decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
            torch::Tensor page_table, torch::Tensor seq_lens, int64_t page_size, int64_t chunk,
            int64_t n_splits, double scale, int64_t bits, torch::Tensor part_acc,
            torch::Tensor part_ml, torch::Tensor out) {
  auto stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  const int rc = tinyserve_iso_decode(
      q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
      page_table.data_ptr<int32_t>(), page_table.stride(0), seq_lens.data_ptr<int32_t>(),
      (int)q.size(0), (int)q.size(1), (int)k_cache.size(1), (int)q.size(2), (int)page_size,
      (int)chunk, (int)n_splits, (float)scale, (int)bits, part_acc.data_ptr<float>(),
      part_ml.data_ptr<float>(), out.data_ptr(), out.stride(0), dtype_code(out), stream);
  check_rc(rc, "iso decode");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("store", &store);
  m.def("dequant_rows", &dequant_rows);
  m.def("decode", &decode);
}
