// placeholder: CUDA kernels registered here
#include <torch/library.h>
