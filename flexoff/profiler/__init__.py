"""The profiler: it measures this machine for the planner's hardware profile, running the runtime's
own kernels where it times them.

- ``machine``: the whole profile (link bandwidths, disk, matmul curves, attention), each figure
  fitted from timed runs; a profile's saving and loading (``saved_or_measured_profile``).
- ``kernels``: a profile's time budget (``Budget``, ``Deadline``) and the compute kernels' timings.
- ``host_overhead``: the runtime's host time per step, measured on a small engine.
- ``sparse_kernel``: the routed experts' matmuls by expert shape.
"""
