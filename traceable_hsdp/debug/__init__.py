"""Debugging tools: :func:`traceable_hsdp.dump_graphs` (``_dump``), its environment
switch ``TRACEABLE_HSDP_DUMP`` (``_dump_env``), and what they read from graphs and
Inductor's output (``_schedule``: the collective table, the post-grad recorder and the
final schedule). They import the runtime and the passes; the runtime imports only
``_dump_env.start_from_env``, at the first ``fully_shard``.
"""
