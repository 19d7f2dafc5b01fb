// flashgen's stand-in for the two PyTorch pieces the CUTLASS example-41
// kernels use for dropout when built with HAS_PYTORCH: the Philox seed/offset
// pair (`at::PhiloxCudaState`) and the function that reads it on the device
// (`at::cuda::philox::unpack`).  Forward and backward both seed
// curand_init(seed, 0, offset + per-(batch, head) offset), so passing the same
// pair to both draws the same dropout mask.  Nothing else of PyTorch is used.
#pragma once

#include <cstdint>
#include <tuple>

namespace at {

struct PhiloxCudaState {
  PhiloxCudaState() = default;
  __host__ __device__ PhiloxCudaState(uint64_t seed_, uint64_t offset_)
      : seed(seed_), offset(offset_) {}
  uint64_t seed = 0;
  uint64_t offset = 0;
};

namespace cuda {
namespace philox {

// std::tuple in device code relies on nvcc's --expt-relaxed-constexpr.
__host__ __device__ inline std::tuple<uint64_t, uint64_t> unpack(const PhiloxCudaState& state) {
  return std::make_tuple(state.seed, state.offset);
}

}  // namespace philox
}  // namespace cuda
}  // namespace at
