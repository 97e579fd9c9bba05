#!/usr/bin/env bash
# On the GPU machine (device tool): code compiled with the flags that make nvcc's output reproducible
# (-objtemp -Xcudafe=--orig_src_path_name=/llama.cpp, as llamabundle passes them) still runs: a CUB sort and
# reduction (CCCL's anonymous namespaces are what the cudafe flag renames) and a template kernel in an
# anonymous namespace, in two translation units of the same base name in different directories, linked
# into one shared library and called from a program; and the library's bytes do not depend on the directory.
set -euo pipefail
W=/tmp/nvflags; rm -rf $W; mkdir -p $W/one/x $W/two/x $W/elsewhere/one/x $W/elsewhere/two/x
for d in one two; do cat > $W/$d/x/k.cu <<CU
#include <cub/cub.cuh>
namespace { template <typename T> __global__ void twice(T *v, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) v[i] *= 2; } }
extern "C" int run_$d(int n) {
  int *keys, *sorted, *sum; cudaMalloc(&keys, n * sizeof(int)); cudaMalloc(&sorted, n * sizeof(int)); cudaMalloc(&sum, sizeof(int));
  int *h = new int[n]; for (int i = 0; i < n; i++) h[i] = (n - i) * 7 % 1000; cudaMemcpy(keys, h, n * sizeof(int), cudaMemcpyHostToDevice);
  twice<<<(n + 255) / 256, 256>>>(keys, n);
  void *tmp = nullptr; size_t bytes = 0;
  cub::DeviceRadixSort::SortKeys(tmp, bytes, keys, sorted, n); cudaMalloc(&tmp, bytes); cub::DeviceRadixSort::SortKeys(tmp, bytes, keys, sorted, n);
  void *tmp2 = nullptr; size_t bytes2 = 0;
  cub::DeviceReduce::Sum(tmp2, bytes2, sorted, sum, n); cudaMalloc(&tmp2, bytes2); cub::DeviceReduce::Sum(tmp2, bytes2, sorted, sum, n);
  int *out = new int[n]; int s = 0; cudaMemcpy(out, sorted, n * sizeof(int), cudaMemcpyDeviceToHost); cudaMemcpy(&s, sum, sizeof(int), cudaMemcpyDeviceToHost);
  long want = 0; for (int i = 0; i < n; i++) want += 2L * h[i];
  for (int i = 1; i < n; i++) if (out[i - 1] > out[i]) return 1;
  return cudaDeviceSynchronize() != cudaSuccess ? 3 : (s == want ? 0 : 2);
}
CU
cp $W/$d/x/k.cu $W/elsewhere/$d/x/k.cu; done
FLAGS="-O3 -Xcompiler=-fPIC --generate-code=arch=compute_75,code=[compute_75] --generate-code=arch=compute_90,code=[sm_90] -objtemp -Xcudafe=--orig_src_path_name=/llama.cpp"
lib() {  # $1 base dir
  for d in one two; do (cd $1/$d && /usr/local/cuda/bin/nvcc $FLAGS -Xcompiler=-ffile-prefix-map=$1=/src -c x/k.cu -o k.o); done
  /usr/local/cuda/bin/nvcc -shared -o $1/libboth.so $1/one/k.o $1/two/k.o
}
lib $W; lib $W/elsewhere
cat > $W/main.c <<'C'
#include <stdio.h>
int run_one(int n); int run_two(int n);
int main(void) { int a = run_one(1 << 20), b = run_two(12345); printf("run_one=%d run_two=%d\n", a, b); return a || b; }
C
gcc -o $W/main $W/main.c -L$W -lboth -Wl,-rpath,$W
$W/main | tee $OUT/nvcc-flags-run.txt
if cmp -s $W/libboth.so $W/elsewhere/libboth.so; then echo "libboth.so identical from both directories: $(sha256sum < $W/libboth.so | cut -c1-16)"; else echo "libboth.so differs"; fi | tee -a $OUT/nvcc-flags-run.txt
