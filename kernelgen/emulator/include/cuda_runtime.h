// Stand-in for <cuda_runtime.h> when a kernel is compiled for the CPU emulator: everything the
// emulated kernels need lives in kg_emulator.h (force-included anyway).
#pragma once
#include "kg_emulator.h"
