"""Pure forward/backward pairs in plain torch: the contract and the reference.

Each op is a pair ``<op>_fwd(*tensors, *, static) -> (out, res)`` and
``<op>_bwd(res, d_out, *, needs=...) -> grads`` with ``res`` a NamedTuple. Nothing here
knows of autograd, streams, process groups or nn.Module.
"""
