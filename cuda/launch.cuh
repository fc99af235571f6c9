// Programmatic dependent launch (Hopper, sm_90+). kernel_modules.Kernel launches our kernels with CUDA's
// programmatic stream serialization, so the next kernel of a stream may start while this one is still running;
// each kernel therefore calls grid_dependency_sync() first, before it touches global memory:
//   launch_dependents: this CTA no longer holds the next kernel back (it starts once every CTA of this grid has
//                      said so or exited), so its launch and its CTAs' placement overlap this kernel's work;
//   wait:              block until the kernel before this one has finished and its writes are visible.
// Launched without the attribute, or compiled for an older GPU, both are no-ops. No buffers, no kernels.

__device__ __forceinline__ void grid_dependency_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
