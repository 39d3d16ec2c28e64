"""The demo application: the ``traceable-hsdp`` command (``cli``), the training job
behind it (``_train``) and the small Llama it trains (``models``, also used by the
tests, examples and benchmarks). It uses the runtime's public surface; nothing in the
runtime imports it.
"""
