"""The passes and the op that only gloo needs: over two gloo ranks each reduce-scatter
and all-gather issued as an all-to-all (``exchange.py``, whose outputs come from the
pool of ``_pool.py``), and every other CPU all-gather issued into a buffer allocated
beforehand (``gather_into_buffers.py``). On any other backend they match nothing.
"""
