"""The conformance suite: every op of the catalogue on a device, checked against the float64 reference.

Run it against any installed backend with ``pytest --pyargs blutrain.kernels.conformance
--blutrain-device=NAME``.
"""
