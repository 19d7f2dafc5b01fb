// Included by the CUTLASS example-41 kernels under HAS_PYTORCH; flashgen needs
// nothing from it beyond the Philox state in CUDAGeneratorImpl.h.
#pragma once
#include <ATen/cuda/CUDAGeneratorImpl.h>
