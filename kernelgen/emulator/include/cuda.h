// Stand-in for the driver API's <cuda.h> for the CPU emulator: kernels include it for the
// CUtensorMap type, which kg_emulator.h (force-included anyway) defines.
#pragma once
#include "kg_emulator.h"
