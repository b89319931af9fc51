"""The command line tools, installed as console commands (setup.py's ``console_scripts``): ``rfa-convert-from-softmax``,
``rfa-redraw-features``, ``rfa-diagnostics`` and ``rfa-average-checkpoints``, one module each (its docstring says what
it does), each with ``main(argv=None)`` and runnable as ``python -m rfa_fairseq.cli.NAME`` too."""
