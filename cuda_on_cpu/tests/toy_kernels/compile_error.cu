// Does not compile: the test checks that the message names this file and line 6.

extern "C" __global__ void broken(float* out) {
  const int t = threadIdx.x;
  out[t] = undeclared_identifier * 2.0f;
}
