"""Inductor FX passes for traceable_hsdp (installed as ``traceable_hsdp.passes``)."""
