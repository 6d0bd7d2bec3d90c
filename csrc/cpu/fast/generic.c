/* generic.c — the fast CPU kernels in portable C (vectorised by the compiler for the baseline
 * ISA). Always built; the other ISAs are chosen over it at run time (fast.c). */
#define FAST(name) name##_generic
#include "simd.h"
#include "isa_kernels.h"
