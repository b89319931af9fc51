"""Step engines: what runs a decoding step in place of the eager modules (``inference.py`` picks one): CUDA graphs
after the first step (``step_graphs``), the compiled layers on the CPU, the first step included (``compiled``)."""
