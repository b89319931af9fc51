"""Step engines: what runs a decoding step after the first in place of the eager modules (``inference.py`` picks one):
CUDA graphs (``step_graphs``), the compiled layers on the CPU (``compiled``)."""
