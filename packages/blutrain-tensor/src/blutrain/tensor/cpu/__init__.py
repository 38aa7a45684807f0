"""The built-in CPU device: a NumPy backend and dtype-generic kernels.

The kernels take their array module from their inputs, so the same code is the CPU implementation,
the float64 reference of the conformance suite, and the long tail of any NumPy-compatible device
(CuPy) until a fused kernel replaces an op there.
"""
